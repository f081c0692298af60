"""The registry of local mounts (fuse/registry.py) without a mount: a record counts only
while the process it names is the one that wrote it and its mount point is mounted,
records of other stores are not listed, a malformed record is skipped, and the store's
name in a record is the same whether the store is open or not."""
from __future__ import annotations

import json
import os
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from kspeedfs.config import StoreConfig
from kspeedfs.fuse import registry
from kspeedfs.manifest.store import identity
from kspeedfs.manifest.store.embedded import EmbeddedStore


def _record(mountpoint: str = "/", **changes: object) -> registry.LocalMount:
    me = registry.LocalMount.of_this_process(mountpoint, "ds", 1, "embedded:/s", "native")
    return replace(me, **changes)


def test_a_record_round_trips_and_malformed_ones_raise_value_error() -> None:
    rec = _record("/mnt/x")
    assert registry.LocalMount.from_json(rec.to_json()) == rec
    assert rec.tag == "ds@1" and rec.pid == os.getpid() and rec.alive()
    for bad in (b"", b"[]", b"{", json.dumps({"format": 2}).encode(),
                json.dumps({**json.loads(rec.to_json()), "version": "1"}).encode(),
                json.dumps({**json.loads(rec.to_json()), "pid": True}).encode()):
        with pytest.raises(ValueError):
            registry.LocalMount.from_json(bad)


def test_only_live_mounted_records_of_the_asked_store_are_listed(tmp_path: Path) -> None:
    """``/`` is mounted, but not as fuse.kspeedfs: a record there is never live; a record
    naming a dead process, or a live pid that started at another time (the pid was
    reused), is not live either, whatever its mount point."""
    child = subprocess.Popen(["true"])
    child.wait()
    records = {"this": _record("/"), "dead": _record("/", pid=child.pid),
               "reused": _record("/", pid_start=1), "other": _record("/", store="embedded:/t")}
    for name, rec in records.items():
        registry.publish(rec, str(tmp_path / f"{name}.mount"))
    (tmp_path / "broken.mount").write_bytes(b"{not json")
    assert records["this"].alive() and not records["dead"].alive()
    assert not records["reused"].alive()
    assert registry.live(run_dir=str(tmp_path)) == []           # / is no kspeedfs mount
    assert registry.live(run_dir=str(tmp_path / "missing")) == []


def test_withdraw_leaves_a_successors_record(tmp_path: Path) -> None:
    path = str(tmp_path / "m.mount")
    mine = _record("/mnt/x")
    registry.publish(replace(mine, pid=1), path)          # a successor wrote over it
    registry.withdraw(mine, path)
    assert os.path.exists(path)
    registry.publish(mine, path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    registry.withdraw(mine, path)
    assert not list(tmp_path.iterdir())


def test_the_store_identity_is_the_same_opened_or_not(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    cfg = StoreConfig(backend="embedded", path=str(tmp_path / "link"))
    assert identity(cfg) == EmbeddedStore(tmp_path / "real").identity == \
        f"embedded:{tmp_path / 'real'}"
    assert identity(StoreConfig(backend="etcd", etcd_prefix="/a/")) == "etcd:/a/"
