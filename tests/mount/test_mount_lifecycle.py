"""Mount lifecycle: clear errors and nothing half-mounted; signals; crash recovery; helpers."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from bench.system import supervisor_pid
from tests.fixtures.mounts import Cluster1, cluster1, daemon_pid, is_mounted, kspeedfs, make_tree


@pytest.fixture
def node(tmp_path: Path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_bytes(b"alpha\n")
    (src / "sub").mkdir()
    (src / "sub" / "b.bin").write_bytes(os.urandom(300_000))
    with cluster1(tmp_path) as c:
        c.import_(src, "ds")
        yield c, src


def _fails(c: Cluster1, mp: Path, *args: str, dataset: str = "ds") -> str:
    r = kspeedfs(["mount", dataset, str(mp), *args, *c.common()], check=False)
    assert r.returncode != 0
    assert not is_mounted(mp)
    assert daemon_pid(mp) is None
    return r.stderr


def test_mount_errors_leave_nothing_mounted(node, tmp_path: Path) -> None:
    c, src = node
    mp = tmp_path / "mp"
    assert "does not exist" in _fails(c, mp)
    mp.mkdir()
    assert "no dataset named 'nope'" in _fails(c, mp, dataset="nope")
    (mp / "x").write_text("x")
    assert "not empty" in _fails(c, mp)
    (mp / "x").unlink()
    moved = tmp_path / "src-moved"
    src.rename(moved)
    assert "is missing" in _fails(c, mp)
    assert "nowhere of dataset ds is missing" in _fails(c, mp, "--source", str(tmp_path / "nowhere"))
    moved.rename(src)
    live = c.mount("ds", mp)
    assert "already a mount point" in kspeedfs(["mount", "ds", str(live), *c.common()],
                                               check=False).stderr
    r = kspeedfs(["mount", "ds", str(tmp_path / "rw"), "-o", "rw", *c.common()], check=False)
    assert r.returncode != 0 and "read-only" in r.stderr


def test_store_unreachable(node, tmp_path: Path) -> None:
    c, _ = node
    mp = tmp_path / "mp"
    mp.mkdir()
    r = kspeedfs(["mount", "ds", str(mp), "--store", "/proc/nope/store",
                  "--set", f"log.dir={c.logs}"], check=False)
    assert r.returncode != 0 and "store" in r.stderr
    assert not is_mounted(mp)


def test_source_override(node, tmp_path: Path) -> None:
    c, src = node
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-a", str(src), str(copy)], check=True)
    (src / "a.txt").unlink()
    mnt = c.mount("ds", None, "--source", str(copy))
    assert (mnt / "a.txt").read_bytes() == b"alpha\n"


def test_sigterm_unmounts_cleanly(node) -> None:
    c, _ = node
    mnt = c.mount("ds")
    pid = daemon_pid(mnt)
    assert pid
    os.kill(pid, signal.SIGTERM)
    _wait(lambda: not is_mounted(mnt) and daemon_pid(mnt) is None)
    assert "SIGTERM: unmounting" in c.log_text()


def test_crashed_daemon_is_cleaned_by_next_mount(node) -> None:
    """Daemon and supervisor both SIGKILLed (a lone daemon is restarted: test_upgrade.py):
    the mount is dead, and the next mount cleans it up."""
    c, src = node
    mnt = c.mount("ds")
    pids = [p for p in (daemon_pid(mnt), supervisor_pid(mnt)) if p is not None]
    # stopped first, then killed: each restarts the other (supervisor.py), so one killed
    # a moment before the other could be replaced in between
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for p in pids:
            os.kill(p, sig)
    _wait(lambda: daemon_pid(mnt) is None)
    with pytest.raises(OSError):
        os.listdir(mnt)                           # ENOTCONN: the dead mount
    c.mount("ds", mnt)
    assert (mnt / "a.txt").read_bytes() == b"alpha\n"
    assert "dead FUSE mount" in c.log_text() or is_mounted(mnt)


def test_umount_command(node) -> None:
    c, _ = node
    mnt = c.mount("ds")
    kspeedfs(["umount", str(mnt)])
    _wait(lambda: not is_mounted(mnt) and daemon_pid(mnt) is None)
    r = kspeedfs(["umount", str(mnt)], check=False)
    assert r.returncode == 1 and "not mounted" in r.stderr


def test_mount_helper_and_fstab_options(node, tmp_path: Path) -> None:
    """``mount -t fuse.kspeedfs`` through mount/mount.fuse.kspeedfs (installed by setup)."""
    c, src = node
    helper = Path("/usr/sbin/mount.fuse.kspeedfs")
    if not helper.exists():
        pytest.skip("mount helper not installed (./run setup installs it)")
    mp = tmp_path / "via-mount"
    mp.mkdir()
    c.mounts.append(mp)
    opts = f"ro,nofail,store.path={c.store},log.dir={c.logs},fuse.read_ahead_kb=1024"
    r = subprocess.run(["mount", "-t", "fuse.kspeedfs", "ds", str(mp), "-o", opts],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert (mp / "sub" / "b.bin").read_bytes() == (src / "sub" / "b.bin").read_bytes()
    minor = os.minor(os.stat(mp).st_dev)
    assert Path(f"/sys/class/bdi/0:{minor}/read_ahead_kb").read_text().strip() == "1024"
    assert Path(f"/sys/fs/fuse/connections/{minor}/max_background").read_text().strip() == "64"
    subprocess.run(["umount", str(mp)], check=True)
    _wait(lambda: daemon_pid(mp) is None)


def test_ls_and_versions(node) -> None:
    c, src = node
    out = kspeedfs(["ls", *c.common()]).stdout
    assert out.splitlines()[0].split()[:5] == ["NAME", "VERSION", "FILES", "BYTES", "CHUNKS"]
    assert out.splitlines()[1].split()[:3] == ["ds", "1", "2"]
    (src / "c.txt").write_text("new")
    c.import_(src, "ds")
    info = json.loads(kspeedfs(["ls", "--json", "--versions", *c.common()]).stdout)
    assert [(i["name"], i["version"], i["files"]) for i in info] == [("ds", 1, 2), ("ds", 2, 3)]
    old = c.mount("ds", None, "--version", "1")
    assert not (old / "c.txt").exists()
    assert (c.mount("ds") / "c.txt").read_text() == "new"


def test_import_progress_and_errors(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", small_files=50)
    c = Cluster1(tmp_path)
    r = kspeedfs(["import", str(src), "--name", "x", *c.common()])
    assert "hash:" in r.stderr and "files/s" in r.stderr and "ETA" in r.stderr
    assert "imported x v1" in r.stdout
    bad = kspeedfs(["import", str(tmp_path / "missing"), "--name", "x", *c.common()], check=False)
    assert bad.returncode == 1 and "missing" in bad.stderr and "Traceback" not in bad.stderr
    bad = kspeedfs(["import", str(src), "--name", "../evil", *c.common()], check=False)
    assert bad.returncode == 2 and "invalid dataset name" in bad.stderr    # a usage error
    bad = kspeedfs(["import", str(src), "--name", "y", "--chunk-size", "1000", *c.common()],
                   check=False)
    assert bad.returncode == 1 and "import.chunk_size" in bad.stderr


def _wait(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
