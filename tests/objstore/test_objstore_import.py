"""``kspeedfs import gs://BUCKET/PREFIX`` and ``az://CONTAINER/PREFIX`` against real emulators
(fake-gcs-server, Azurite): keys become paths, the manifest records each object's
identity and no secret, and every failure a user can cause is one line."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from kspeedfs import config
from kspeedfs.manifest.importer import import_tree
from kspeedfs.manifest.index import ManifestIndex
from kspeedfs.manifest.store.embedded import EmbeddedStore
from kspeedfs.objstore import connect
from kspeedfs.objstore.azure import DEV_KEY
from kspeedfs.objstore.source import ObjectSource
from tests.fixtures.azurite import connection_string
from tests.fixtures.mounts import kspeedfs
from tests.fixtures.s3 import FaultProxy
from tests.objstore.conftest import Store

CHUNK = 256 << 10


def _import(url: str, store: EmbeddedStore) -> tuple[Any, ManifestIndex, bytes]:
    cfg = config.load(environ={})
    info = import_tree(ObjectSource(connect(url, cfg.source), 8), "ds", store, CHUNK)
    blob = store.manifest("ds", info.version)
    return info, ManifestIndex.from_blob(blob, info.inflated_size), blob


def test_keys_become_paths(store: Store, tmp_path: Path) -> None:
    bodies = {
        "a/b/c.jpg": b"jpeg" * 100,
        "a/space name.txt": b"spaces",
        "uni/ünïcødé %41%2F.bin": b"percent and unicode",
        "empty": b"",
        "marker-dir/": b"",              # a "directory marker": a directory, no file
        "x": b"file named like a dir",   # beside x/y: the directory wins
        "x/y": b"y",
        "big": bytes(range(256)) * (3 * CHUNK // 256 + 7),    # split over four chunks
    }
    store.put_many({"pre/" + k: v for k, v in bodies.items()})
    store.put_many({"prelude.txt": b"outside the prefix", "other/z": b"outside"})

    info, ix, blob = _import(store.url("pre"), EmbeddedStore(tmp_path / "store"))
    assert info.source == store.url("pre/")
    paths = {ix.path(e).decode(): e for e in ix.walk()}
    assert set(paths) == {"a", "a/b", "a/b/c.jpg", "a/space name.txt", "uni",
                          "uni/ünïcødé %41%2F.bin", "empty", "marker-dir", "x", "x/y", "big"}
    assert ix.is_dir(paths["marker-dir"]) and ix.is_dir(paths["x"])
    for rel, body in bodies.items():
        if rel in paths and ix.is_file(paths[rel]):
            e = paths[rel]
            etag, version, mtime = store.identity("pre/" + rel)
            assert ix.size[e] == len(body)
            got_etag, got_version = ix.object_identity(e)
            assert got_etag.strip('"') == etag.strip('"'), rel
            # GCS: the generation the import's first GET was served (none for an empty
            # object, which is never read); Azurite keeps no versions
            assert got_version == (version if body else ""), rel
            assert abs(ix.mtime_ns[e] / 1e9 - mtime) < 1.0, rel
    record = ix.source_record
    assert record is not None and record["url"] == store.url("pre/")
    assert record["endpoint"].startswith(store.server.endpoint)
    for secret in store.secrets:
        assert secret.encode() not in ManifestIndex.from_blob(blob)._raw


def test_many_small_objects(store: Store, tmp_path: Path) -> None:
    """1,000 objects over 7 prefixes: listed in parallel, packed into chunks."""
    sizes = [(i * 37) % 3001 for i in range(1000)]
    store.put_many({f"d{i % 7}/s{i:05d}": b"z" * sizes[i] for i in range(1000)})
    info, _, _ = _import(store.url(), EmbeddedStore(tmp_path / "store"))
    assert info.files == 1000 and info.bytes == sum(sizes)
    assert info.chunks <= sum(sizes) // CHUNK + 2


def _one_line_failure(args: list[str], env: dict[str, str], secrets: list[str]) -> str:
    """The error line of a failing command (-q: no progress lines beside it)."""
    proc = kspeedfs([*args, "-q"], check=False, env=env)
    assert proc.returncode == 1, proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for secret in secrets:
        assert secret not in proc.stderr + proc.stdout
    return lines[0]


def test_cli_import_verbose_no_secret(store: Store, tmp_path: Path) -> None:
    store.put("t/one", b"1")
    out = kspeedfs(["import", store.url("t"), "--name", "v", "--json", "--verbose",
                    "--store", str(tmp_path)])
    assert f'"source": "{store.url("t/")}"' in out.stdout
    st = EmbeddedStore(tmp_path)
    info = st.dataset("v")
    stored = (ManifestIndex.from_blob(st.manifest("v", info.version))._raw
              + repr(info.to_json()).encode())
    for secret in store.secrets:
        assert secret not in out.stdout + out.stderr and secret.encode() not in stored


def test_missing_bucket_empty_prefix_and_bad_keys_one_line(store: Store, tmp_path: Path) -> None:
    env = dict(os.environ)
    line = _one_line_failure(["import", f"{store.scheme}://kst-no-such-bucket/p", "--name", "d",
                              "--store", str(tmp_path)], env, store.secrets)
    # fake-gcs-server answers a missing bucket with a 500 where GCS says 404
    assert "kst-no-such-bucket" in line and ("(HTTP 404)" in line if store.scheme == "az"
                                             else "no bucket named" in line)
    line = _one_line_failure(["import", store.url("nothing"), "--name", "d", "--store",
                              str(tmp_path)], env, store.secrets)
    assert "no objects under this prefix" in line
    store.put("bad/a//b", b"x")         # object_store cannot hold an empty path component
    line = _one_line_failure(["import", store.url("bad"), "--name", "d", "--store",
                              str(tmp_path)], env, store.secrets)
    assert store.url("bad/") in line and "empty, . or .. component" in line


def test_wrong_credentials_one_line(store: Store, tmp_path: Path) -> None:
    """Azurite checks Shared Key signatures: another key is refused (403). fake-gcs-server
    checks nothing, so a proxy in front of it answers as GCS does to a bad token (401)."""
    store.put("p/one", b"1")
    args = ["import", store.url("p"), "--name", "d", "--store", str(tmp_path)]
    if store.scheme == "az":
        wrong = DEV_KEY[:-12] + "AAAAAAAAAAA="
        env = {**os.environ, "AZURE_STORAGE_CONNECTION_STRING":
               connection_string(store.server.endpoint, wrong)}
        line = _one_line_failure(args, env, [*store.secrets, wrong])
        assert store.url("p/") in line and "(HTTP 403)" in line
        return
    with FaultProxy(store.server) as proxy:
        proxy.fail(1000, 401, "AuthenticationRequired")
        line = _one_line_failure(args, {**os.environ, **proxy.env()}, store.secrets)
    assert store.url("p/") in line and "AuthenticationRequired (HTTP 401)" in line


def test_missing_credentials_one_line(store: Store, tmp_path: Path) -> None:
    """No request is made: GCS's credentials file cannot be read, Azure has no account."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("STORAGE_EMULATOR", "AZURE_"))}
    env["GOOGLE_APPLICATION_CREDENTIALS"] = str(tmp_path / "no-such-key.json")
    line = _one_line_failure(["import", store.url("p"), "--name", "d", "--store",
                              str(tmp_path)], env, store.secrets)
    if store.scheme == "gs":
        assert "no-such-key.json cannot be read" in line
    else:
        assert "no Azure storage account" in line


def test_config_hides_azure_secrets(tmp_path: Path) -> None:
    (tmp_path / "none.toml").write_text("")
    env = {**os.environ, "KSPEEDFS_CONFIG": str(tmp_path / "none.toml"),
           "KSPEEDFS_SOURCE_AZURE_KEY": "kst-az-key-do-not-print",
           "KSPEEDFS_SOURCE_AZURE_SAS": "sv=2024&sig=kst-sas-do-not-print",
           "KSPEEDFS_SOURCE_AZURE_CONNECTION_STRING": "AccountKey=kst-cs-do-not-print",
           "KSPEEDFS_SOURCE_GCS_CREDENTIALS": "/etc/kst-gcs.json"}
    out = kspeedfs(["config"], env=env).stdout
    assert 'azure_key = "***"' in out and 'azure_sas = "***"' in out
    assert 'gcs_credentials = "/etc/kst-gcs.json"' in out        # a path, not a secret
    for secret in ("kst-az-key-do-not-print", "kst-sas-do-not-print", "kst-cs-do-not-print"):
        assert secret not in out


@pytest.mark.parametrize("url", ["gs://B/p", "az://a--b/p", "az://x"])
def test_bad_bucket_names_one_line(url: str, tmp_path: Path) -> None:
    line = _one_line_failure(["import", url, "--name", "d", "--store", str(tmp_path)],
                             dict(os.environ), [])
    assert "is not a" in line
