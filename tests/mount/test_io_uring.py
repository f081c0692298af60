"""FUSE over io_uring (``fuse.io_uring = auto``, native/fuse_uring.c): negotiated
and used when the kernel allows it, /dev/fuse when it does not, and the lifecycle rule of
an io_uring mount (no upgrade, no supervisor: a crash ends the mount, it never hangs a
reader). Each test sets ``/sys/module/fuse/parameters/enable_uring`` itself and puts the
old value back; ./run's sanitizer lane runs these, test_mount and test_integrity again
over io_uring."""
from __future__ import annotations

import errno
import mmap
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.system import supervisor_pid
from tests.fixtures.mounts import Cluster1, assert_same_tree, daemon_pid, is_mounted, kspeedfs, make_tree
from tests.fixtures.mounts import mount_stats as _stats

ENABLE = Path("/sys/module/fuse/parameters/enable_uring")

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or os.environ.get("KSPEEDFS_FUSE_ENGINE") == "pyfuse3" or not ENABLE.exists(),
    reason="io_uring is the native engine's (root), on kernels with CONFIG_FUSE_IO_URING")


@pytest.fixture
def enable_uring() -> Iterator[callable]:
    """``enable_uring(True/False)`` for this test; the value before it is restored after."""
    before = ENABLE.read_text().strip()

    def set_(on: bool) -> None:
        ENABLE.write_text("Y" if on else "N")

    yield set_
    ENABLE.write_text(before)


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("uring")
    src = make_tree(base / "src", small_files=300)
    c = Cluster1(base)
    c.import_(src, "ring")
    return base, src


def _mount(tmp_path: Path, tree: tuple[Path, Path], mode: str) -> tuple[Cluster1, Path]:
    base, _ = tree
    c = Cluster1(base)
    c.logs = tmp_path / "log"                         # this mount's log only
    return c, c.mount("ring", tmp_path / "mnt", "--set", f"fuse.io_uring={mode}")


def test_io_uring_is_negotiated_and_serves_every_request(tree, enable_uring, tmp_path: Path) -> None:
    _, src = tree
    enable_uring(True)
    c, mnt = _mount(tmp_path, tree, "auto")
    try:
        assert _stats(mnt)["transport"] == "native io_uring"
        before = _stats(mnt)["ring_requests"]
        assert_same_tree(src, mnt)              # misses: Python answers on ring entries
        assert_same_tree(src, mnt)              # hits: copied into ring payloads in C
        threads = [threading.Thread(target=assert_same_tree, args=(src, mnt)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a reader hung"
        s = _stats(mnt)
        # every LOOKUP/GETATTR/READ/GETXATTR above came through a ring, not /dev/fuse
        assert s["ring_requests"] - before > 3 * 300
        assert s["ring_copy_bytes"] > 0 and s["ring_lost"] == 0
        assert "over io_uring" in c.log_text()
    finally:
        c.close()
    assert not is_mounted(mnt)


@pytest.mark.parametrize("enabled, mode", [(False, "auto"), (True, "off")])
def test_dev_fuse_when_the_kernel_or_the_config_says_no(tree, enable_uring, tmp_path: Path,
                                                        enabled: bool, mode: str) -> None:
    _, src = tree
    enable_uring(enabled)
    c, mnt = _mount(tmp_path, tree, mode)
    try:
        assert_same_tree(src, mnt)
        s = _stats(mnt)
        assert s["transport"] == "native /dev/fuse" and s["ring_requests"] == 0
        log = c.log_text()
        assert "over /dev/fuse" in log
        assert ("io_uring: not offered by the kernel" in log) == (mode == "auto")
        assert supervisor_pid(mnt) is not None        # a /dev/fuse mount is supervised
    finally:
        c.close()


def test_an_io_uring_mount_refuses_upgrade_and_a_crash_ends_it_without_hanging(
        tree, enable_uring, tmp_path: Path) -> None:
    _, src = tree
    enable_uring(True)
    c, mnt = _mount(tmp_path, tree, "auto")
    try:
        assert supervisor_pid(mnt) is None            # nothing would resume its rings
        pid = daemon_pid(mnt)
        r = kspeedfs(["mount", "ring", str(mnt), "--upgrade", *c.common()], check=False)
        assert r.returncode != 0 and "io_uring" in r.stderr, r.stderr
        assert daemon_pid(mnt) == pid                 # the old daemon still serves
        assert_same_tree(src, mnt)
        # readers in flight when the daemon dies get an error, none hangs
        errors: list[OSError] = []
        stop = threading.Event()

        files = sorted(p for p in mnt.rglob("*") if p.is_file() and p.stat().st_size)

        def read() -> None:                  # O_DIRECT: every read is a FUSE READ
            buf = mmap.mmap(-1, 1 << 20)
            while not stop.is_set():
                for p in files:
                    try:
                        fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
                        try:
                            os.preadv(fd, [buf], 0)
                        finally:
                            os.close(fd)
                    except OSError as e:
                        errors.append(e)
                        return

        readers = [threading.Thread(target=read, daemon=True) for _ in range(4)]
        for t in readers:
            t.start()
        time.sleep(0.5)
        os.kill(pid, signal.SIGKILL)
        for t in readers:
            t.join(timeout=20)
        stop.set()
        assert not any(t.is_alive() for t in readers), "a reader hung after the crash"
        # ENOTCONN (new requests), ECONNABORTED (ended by the abort), ECANCELED (sent to a
        # ring entry of the dying daemon: the kernel ends it when the task is gone)
        assert len(errors) == 4, errors
        assert {e.errno for e in errors} <= {errno.ENOTCONN, errno.ECONNABORTED, errno.ECANCELED}, errors
    finally:
        c.close()
    assert not is_mounted(mnt)


def test_a_ring_that_cannot_be_set_up_after_init_falls_back_to_dev_fuse(tree, enable_uring,
                                                                          tmp_path: Path) -> None:
    """INIT negotiated io_uring (the kernel then holds every request until the ring is
    ready), but the queues cannot be made (here: 1000 entries per queue, over the
    engine's 256): the engine makes the kernel turn io_uring off (a REGISTER it refuses)
    and /dev/fuse serves; nothing waits for a ring that never comes."""
    from kspeedfs.config import load
    from kspeedfs.daemon import MountRequest, load_dataset
    from kspeedfs.fuse import connection

    base, _ = tree
    enable_uring(True)
    cfg = load(overrides={"store.path": str(base / "store")}, environ={})
    _, _, index = load_dataset(cfg, MountRequest("ring", str(tmp_path)))
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    fd = connection._engine.mount(str(mnt), "kspeedfs:ring", False, False, 256 * 4096)
    engine = connection._engine.Engine(fd, index, uring=True, uring_depth=1000)
    try:
        engine.init()               # (no request on the mount until start: the kernel holds them)
        engine.start(2)
        transport, why = engine.transport()
        assert transport == "/dev/fuse" and "1000 entries" in why, (transport, why)
        assert not engine.negotiated()[1] & connection.FUSE_OVER_IO_URING
        names = []
        t = threading.Thread(target=lambda: names.extend(os.listdir(mnt)), daemon=True)
        t.start()
        t.join(timeout=10)
        assert not t.is_alive(), "a request waited for the ring"
        assert names and engine.counters()["ring_requests"] == 0
    finally:
        connection._engine.unmount(str(mnt))         # the readers then read ENODEV and end
        engine.join()
        engine.close()
