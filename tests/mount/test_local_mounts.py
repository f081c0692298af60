"""A single machine's mounts hold their versions (fuse/registry.py, cluster/lifecycle.py
``pinned_versions``), with real mounts of an embedded store: ``rm`` of a mounted version
is refused in one line naming the mount, ``--force`` removes it, ``gc`` keeps it, a
daemon killed with SIGKILL blocks nothing, and ``status`` lists the mounts with their
tier use."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from bench.system import supervisor_pid
from kspeedfs.fuse import registry
from kspeedfs.fuse.upgrade import socket_path
from tests.fixtures.mounts import cluster1, daemon_pid, kspeedfs

DEFAULT = ("--set", "fuse.xattrs=false")        # as a user mounts: no introspection xattrs


@pytest.fixture
def node(tmp_path: Path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(os.urandom(600_000))
    with cluster1(tmp_path) as c:
        c.import_(src, "ds")
        yield c, src


def _versions(c) -> list[int]:
    return [d["version"] for d in json.loads(kspeedfs(["ls", "--versions", "--json",
                                                       *c.common()]).stdout)]


def test_rm_of_a_mounted_version_is_refused_naming_the_mount_and_force_removes_it(node) -> None:
    c, src = node
    mnt = c.mount("ds", None, *DEFAULT)
    r = kspeedfs(["rm", "ds", *c.common()], check=False)
    assert r.returncode == 1 and r.stdout == "", r.stdout
    assert r.stderr.splitlines() == [f"kspeedfs rm: error: ds@1 is mounted at "
                                     f"{os.uname().nodename}:{mnt} (unmount it first, or --force)"]
    assert _versions(c) == [1]
    r = kspeedfs(["rm", "ds@1", "--force", *c.common()])
    assert r.stdout.startswith("removed ds@1") and "still mounted: mounted at" in r.stdout
    assert _versions(c) == []
    assert (mnt / "a.bin").read_bytes() == (src / "a.bin").read_bytes()   # it reads on


def test_gc_keeps_a_mounted_version_and_rm_works_once_unmounted(node) -> None:
    c, src = node
    for _ in range(2):
        c.import_(src, "ds", "--set", "store.keep_versions=0")        # versions 2, 3
    mnt = c.mount("ds", None, "--version", "1", *DEFAULT)
    r = kspeedfs(["gc", "--keep", "1", "--json", *c.common()])
    assert json.loads(r.stdout)["removed"] == {"ds": [2]}            # 1 is mounted, 3 newest
    assert _versions(c) == [1, 3]
    kspeedfs(["umount", str(mnt)])
    kspeedfs(["rm", "ds@1", *c.common()])       # free once umount returned (not once the daemon exits)
    assert _versions(c) == [3]


def test_a_killed_daemons_leftover_record_blocks_nothing(node) -> None:
    c, _ = node
    mnt = c.mount("ds", None, *DEFAULT)
    record = registry.record_path(socket_path(str(mnt)))
    assert [m.mountpoint for m in registry.live() if m.mountpoint == str(mnt)] == [str(mnt)]
    # both at once (a native mount's supervisor would resume a daemon killed alone, and
    # a daemon outliving its supervisor starts another)
    pids = [pid for pid in (supervisor_pid(mnt), daemon_pid(mnt)) if pid is not None]
    for sig in (signal.SIGSTOP, signal.SIGKILL):      # stopped first: neither reacts
        for pid in pids:
            os.kill(pid, sig)
    deadline = time.monotonic() + 10
    while daemon_pid(mnt) is not None:
        assert time.monotonic() < deadline, "the daemon did not die"
        time.sleep(0.05)
    assert os.path.exists(record)                 # left behind, still mounted (ENOTCONN) ...
    r = kspeedfs(["rm", "ds", *c.common()])       # ... and ignored
    assert r.stdout.strip() == "removed ds@1"
    assert str(mnt) not in [m.mountpoint for m in registry.live()]


def test_status_on_a_single_machine_lists_the_mounts_with_their_tier_use(node) -> None:
    c, src = node
    mnt = c.mount("ds", None, *DEFAULT)
    assert (mnt / "a.bin").read_bytes() == (src / "a.bin").read_bytes()
    st = json.loads(kspeedfs(["status", "--json", *c.common()]).stdout)
    [m] = st["mounts"]
    assert (m["mountpoint"], m["tag"], m["unreachable"]) == (str(mnt), "ds@1", None)
    assert m["read_bytes"] == 600_000 and m["memory_bytes"] > 0 and m["disk_bytes"] == 0
    assert 0 <= m["hit_ratio"] <= 1
    lines = kspeedfs(["status", *c.common()]).stdout.splitlines()
    assert "1 live mount(s)" in lines[0]
    assert lines[1].split() == ["MOUNTPOINT", "DATASET", "ENGINE", "MEMORY", "DISK", "HIT", "READ",
                                "UP"]
    assert lines[2].split()[:2] == [str(mnt), "ds@1"]
    kspeedfs(["umount", str(mnt)])
    assert json.loads(kspeedfs(["status", "--json", *c.common()]).stdout)["mounts"] == []
