"""``kspeedfs import s3://BUCKET/PREFIX`` against a real S3 server (moto): keys become
paths, the manifest records each object's identity and no secret, and every failure a
user can cause is one line."""
from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest

from kspeedfs import config
from kspeedfs.manifest.index import ManifestIndex
from kspeedfs.manifest.store.embedded import EmbeddedStore
from kspeedfs.objstore import connect
from kspeedfs.objstore.source import ObjectSource
from tests.fixtures.mounts import kspeedfs
from tests.fixtures.s3 import ACCESS_KEY, SECRET_KEY, S3Server

CHUNK = 256 << 10


def _import(url: str, store: EmbeddedStore, **kw: Any) -> tuple[Any, ManifestIndex, bytes]:
    from kspeedfs.manifest.importer import import_tree

    cfg = config.load(environ={})
    info = import_tree(ObjectSource(connect(url, cfg.source), 8), "ds", store, CHUNK, **kw)
    blob = store.manifest("ds", info.version)
    return info, ManifestIndex.from_blob(blob, info.inflated_size), blob


def test_keys_become_paths(aws_env: S3Server, bucket: tuple[Any, str], tmp_path: Path) -> None:
    c, b = bucket
    bodies = {
        "a/b/c.jpg": b"jpeg" * 100,
        "a/space name.txt": b"spaces",
        "uni/ünïcødé %41%2F.bin": b"percent and unicode",
        "empty": b"",
        "marker-dir/": b"",              # a "directory marker": a directory, no file
        "bad//key": b"x",                # an empty component: no path, skipped
        "dots/../up": b"x",              # .. : skipped
        "x": b"file named like a dir",   # beside x/y: the directory wins
        "x/y": b"y",
    }
    for k, v in bodies.items():
        c.put_object(Bucket=b, Key="pre/" + k, Body=v)
    c.put_object(Bucket=b, Key="prelude.txt", Body=b"outside the prefix")
    c.put_object(Bucket=b, Key="other/z", Body=b"outside the prefix")

    info, ix, blob = _import(f"s3://{b}/pre", EmbeddedStore(tmp_path / "store"))
    assert info.source == f"s3://{b}/pre/"
    paths = {ix.path(e).decode(): e for e in ix.walk()}
    assert set(paths) == {"a", "a/b", "a/b/c.jpg", "a/space name.txt", "uni",
                          "uni/ünïcødé %41%2F.bin", "empty", "marker-dir", "x", "x/y"}
    assert ix.is_dir(paths["marker-dir"]) and ix.is_dir(paths["x"])
    for rel, body in bodies.items():
        if rel in paths and ix.is_file(paths[rel]):
            e = paths[rel]
            head = c.head_object(Bucket=b, Key="pre/" + rel)
            assert ix.size[e] == len(body)
            assert ix.object_identity(e) == (head["ETag"], "")
            assert ix.mtime_ns[e] == int(head["LastModified"].timestamp() * 1e9)
    record = ix.source_record
    assert record == {"url": f"s3://{b}/pre/", "endpoint": aws_env.endpoint, "region": "us-east-1"}
    assert SECRET_KEY.encode() not in ManifestIndex.from_blob(blob)._raw


def test_many_small_objects_pack_into_chunks(aws_env: S3Server, bucket: tuple[Any, str],
                                             tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """2,000 objects in the default lane (moto takes ~6 ms a PUT: 10^4 cost a minute to
    upload alone); 10^4 with --run-slow."""
    from concurrent.futures import ThreadPoolExecutor

    c, b = bucket
    n = 10_000 if request.config.getoption("--run-slow") else 2_000
    rnd = random.Random(5)
    sizes = [rnd.randint(0, 3000) for _ in range(n)]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: c.put_object(Bucket=b, Key=f"d{i % 7}/s{i:05d}", Body=b"z" * sizes[i]),
                      range(n)))
    info, ix, _ = _import(f"s3://{b}", EmbeddedStore(tmp_path / "store"))
    assert info.files == n and info.bytes == sum(sizes)
    assert info.chunks == -(-sum(sizes) // CHUNK) or info.chunks <= sum(sizes) // CHUNK + 2


def test_cli_import_json(aws_env: S3Server, bucket: tuple[Any, str], tmp_path: Path) -> None:
    c, b = bucket
    c.put_object(Bucket=b, Key="t/one", Body=b"1")
    out = kspeedfs(["import", f"s3://{b}/t", "--name", "cli", "--json", "--store", str(tmp_path)])
    assert '"source": "s3://' + b + '/t/"' in out.stdout and SECRET_KEY not in out.stdout + out.stderr


def test_no_credential_in_verbose_logs(aws_env: S3Server, bucket: tuple[Any, str],
                                       tmp_path: Path) -> None:
    """At DEBUG botocore prints request headers (the access key id in Authorization): its
    loggers stay at WARNING, so neither key reaches a log, nor the store."""
    c, b = bucket
    c.put_object(Bucket=b, Key="t/one", Body=b"1")
    out = kspeedfs(["import", f"s3://{b}/t", "--name", "v", "--verbose", "--store", str(tmp_path)])
    assert "DEBUG" in out.stderr or "INFO" in out.stderr
    store = EmbeddedStore(tmp_path)
    info = store.dataset("v")
    stored = (ManifestIndex.from_blob(store.manifest("v", info.version))._raw
              + repr(info.to_json()).encode())            # the manifest inflated, the record
    for secret in (SECRET_KEY, ACCESS_KEY):
        assert secret not in out.stdout + out.stderr and secret.encode() not in stored


def _one_line_failure(args: list[str], env: dict[str, str]) -> str:
    """The error line of a failing command (-q: no progress lines beside it)."""
    proc = kspeedfs([*args, "-q"], check=False, env=env)
    assert proc.returncode == 1, proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert SECRET_KEY not in proc.stderr + proc.stdout
    return lines[0]


def test_wrong_credentials_one_line(tmp_path: Path) -> None:
    with S3Server(enforce_auth=True) as s3:     # every key is unknown to this server
        env = {**os.environ, **s3.env()}
        line = _one_line_failure(["import", "s3://kst-denied/p", "--name", "d",
                                  "--store", str(tmp_path)], env)
    assert "s3://kst-denied/p/" in line and "InvalidAccessKeyId (HTTP 403)" in line


def test_no_credentials_one_line(aws_env: S3Server, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    env["AWS_EC2_METADATA_DISABLED"] = "true"       # no instance role to ask
    line = _one_line_failure(["import", "s3://kst-none/p", "--name", "d", "--store",
                              str(tmp_path)], env)
    assert "no S3 credentials" in line


def test_missing_bucket_and_empty_prefix_one_line(aws_env: S3Server, bucket: tuple[Any, str],
                                                  tmp_path: Path) -> None:
    _, b = bucket
    env = dict(os.environ)
    line = _one_line_failure(["import", "s3://kst-no-such-bucket/p", "--name", "d",
                              "--store", str(tmp_path)], env)
    assert "NoSuchBucket (HTTP 404)" in line
    line = _one_line_failure(["import", f"s3://{b}/nothing", "--name", "d", "--store",
                              str(tmp_path)], env)
    assert "no objects under this prefix" in line
    line = _one_line_failure(["import", "hdfs://b/p", "--name", "d", "--store", str(tmp_path)], env)
    assert "unknown source scheme" in line


def test_config_hides_source_secrets(tmp_path: Path) -> None:
    env = {**os.environ, "KSPEEDFS_SOURCE_ACCESS_KEY_ID": "kst-id",
           "KSPEEDFS_SOURCE_SECRET_ACCESS_KEY": SECRET_KEY,
           "KSPEEDFS_SOURCE_SESSION_TOKEN": "kst-token-do-not-print",
           "KSPEEDFS_CONFIG": str(tmp_path / "none.toml")}
    (tmp_path / "none.toml").write_text("")
    out = kspeedfs(["config"], env=env).stdout
    assert "[source]" in out and 'secret_access_key = "***"' in out
    assert SECRET_KEY not in out and "kst-token-do-not-print" not in out
