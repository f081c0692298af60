"""A gs:// or az:// prefix imported and mounted (node-less, the embedded store): every byte
read through the kernel comes from ranged GETs checked against the manifest, and an
object overwritten after import is EIO for its readers only."""
from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from tests.fixtures.mounts import assert_files, cluster1
from tests.fixtures.objects import awkward_objects
from tests.objstore.conftest import Store


def test_mount_reads_every_byte(store: Store, tmp_path: Path) -> None:
    objects = awkward_objects("train", 16 << 20, 300)    # large.bin: 64 chunks of 256 KiB
    store.put_many(objects)
    with cluster1(tmp_path) as node:
        node.import_(store.url("train"), "ds")            # type: ignore[arg-type]
        mnt = node.mount("ds")
        assert_files(mnt, {k[len("train/"):]: v for k, v in objects.items() if not k.endswith("/")})
        assert (mnt / "empty-dir-marker").is_dir()
        _, _, mtime = store.identity("train/a/b/c/deep.jpg")
        assert abs(os.stat(mnt / "a/b/c/deep.jpg").st_mtime - mtime) < 1.0


def test_object_overwritten_after_import(store: Store, tmp_path: Path) -> None:
    objects = {f"p/img{i:02d}.jpg": bytes([i]) * 3000 for i in range(20)}   # one chunk
    store.put_many(objects)
    with cluster1(tmp_path) as node:
        node.import_(store.url("p"), "ds")                # type: ignore[arg-type]
        store.put("p/img07.jpg", b"changed" * 400)
        mnt = node.mount("ds")
        with pytest.raises(OSError) as err:
            (mnt / "img07.jpg").read_bytes()
        assert err.value.errno == errno.EIO
        for i in range(20):                 # its neighbours in the same chunk: unchanged
            if i != 7:
                assert (mnt / f"img{i:02d}.jpg").read_bytes() == bytes([i]) * 3000
        with pytest.raises(OSError):        # and it stays EIO, never the new bytes
            (mnt / "img07.jpg").read_bytes()
        log = node.log_text()
        # GCS: the imported generation is gone (404); Azure: If-Match answered 412
        assert store.url("p/img07.jpg") in log and ("no longer version" in log or "HTTP 412" in log)
        for secret in store.secrets:
            assert secret not in log
