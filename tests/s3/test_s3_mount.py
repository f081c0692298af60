"""A bucket prefix imported and mounted (node-less, the embedded store): every byte read
through the kernel comes from ranged GETs checked against the manifest, an object
overwritten after import is EIO for its readers only, and a stalled source ETIMEDOUT
within ``source.read_deadline``."""
from __future__ import annotations

import errno
import os
import time
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.mounts import assert_files, cluster1
from tests.fixtures.objects import awkward_objects
from tests.fixtures.s3 import FaultProxy, S3Server


def _put(c: Any, b: str, objects: dict[str, bytes]) -> None:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda kv: c.put_object(Bucket=b, Key=kv[0], Body=kv[1]), objects.items()))


def test_mount_reads_every_byte(aws_env: S3Server, bucket: tuple[Any, str], tmp_path: Path) -> None:
    c, b = bucket
    # 4 MiB chunks, the default: large.bin is 16 of them. moto copies the whole object for
    # each ranged GET, so the tests' 256 KiB chunks cost 256 copies of 64 MiB (~45 s).
    objects = awkward_objects("train", 64 << 20, 1000)
    _put(c, b, objects)
    with cluster1(tmp_path, chunk=4 << 20) as node:
        node.import_(f"s3://{b}/train", "ds")           # type: ignore[arg-type]
        mnt = node.mount("ds")
        assert_files(mnt, {k[len("train/"):]: v for k, v in objects.items() if not k.endswith("/")})
        assert (mnt / "empty-dir-marker").is_dir()
        for page in c.get_paginator("list_objects_v2").paginate(Bucket=b, Prefix="train/"):
            for o in page["Contents"]:
                if not o["Key"].endswith("/"):
                    st = os.stat(mnt / o["Key"][len("train/"):])
                    assert st.st_mtime == o["LastModified"].timestamp(), o["Key"]


def test_object_overwritten_after_import(aws_env: S3Server, bucket: tuple[Any, str],
                                         tmp_path: Path) -> None:
    c, b = bucket
    objects = {f"p/img{i:02d}.jpg": bytes([i]) * 3000 for i in range(20)}   # one chunk
    _put(c, b, objects)
    with cluster1(tmp_path) as node:
        node.import_(f"s3://{b}/p", "ds")               # type: ignore[arg-type]
        c.put_object(Bucket=b, Key="p/img07.jpg", Body=b"changed" * 400)
        mnt = node.mount("ds")
        with pytest.raises(OSError) as err:
            (mnt / "img07.jpg").read_bytes()
        assert err.value.errno == errno.EIO
        for i in range(20):                 # its neighbours in the same chunk: unchanged
            if i != 7:
                assert (mnt / f"img{i:02d}.jpg").read_bytes() == bytes([i]) * 3000
        with pytest.raises(OSError):        # and it stays EIO, never the new bytes
            (mnt / "img07.jpg").read_bytes()
        assert f"s3://{b}/p/img07.jpg no longer has the ETag recorded at import" in node.log_text()


def test_stalled_source_read_is_etimedout_within_the_deadline(
        aws_env: S3Server, bucket: tuple[Any, str], tmp_path: Path) -> None:
    """The mount reads through a proxy that holds every GET 8 s (each attempt may wait 10 s):
    a reader gets ETIMEDOUT after ``source.read_deadline``, and its bytes once the source
    answers again."""
    c, b = bucket
    objects = {f"p/f{i}.bin": bytes([i]) * (300 << 10) for i in range(3)}     # a chunk or two each
    _put(c, b, objects)
    with cluster1(tmp_path) as node, FaultProxy(aws_env) as proxy:
        node.import_(f"s3://{b}/p", "ds")               # type: ignore[arg-type]
        mnt = node.mount("ds", None, "--set", f"source.endpoint={proxy.endpoint}",
                         "--set", "source.timeout=10", "--set", "source.read_deadline=1.5")
        proxy.delay(1000, 8.0)
        t0 = time.monotonic()
        with pytest.raises(OSError) as err:
            (mnt / "f1.bin").read_bytes()
        took = time.monotonic() - t0
        # each READ ends at the deadline; when the kernel's readahead READ failed it asks
        # again for the page: two READs at most
        assert err.value.errno == errno.ETIMEDOUT and 1.5 <= took < 2 * 1.5 + 0.5, (err.value, took)
        assert f"s3://{b}/p/f1.bin: no answer within source.read_deadline (1.5 s)" in node.log_text()
        proxy.clear()
        assert (mnt / "f1.bin").read_bytes() == objects["p/f1.bin"]
