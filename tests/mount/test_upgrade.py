"""Upgrading a live mount's daemon (``kspeedfs mount --upgrade``, fuse/upgrade.py): the new
daemon takes the /dev/fuse connection over, the old one stops reading and exits, and
readers going through the daemon the whole time (O_DIRECT: every read is a FUSE READ,
not a page-cache hit) see at most a pause — no error, no wrong byte, no hung reader."""
from __future__ import annotations

import hashlib
import mmap
import os
import threading
import time
from pathlib import Path

import pytest

from tests.fixtures.mounts import Cluster1, cluster1, daemon_pid, is_mounted, kspeedfs

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or os.environ.get("KSPEEDFS_FUSE_ENGINE") == "pyfuse3",
    reason="an upgrade hands over a native-engine connection (root, fuse.engine=native)")

READ = 128 << 10


@pytest.fixture
def served(tmp_path: Path):
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    rnd = __import__("random").Random(3)
    for i in range(24):
        (src / "d" / f"f{i:02d}.bin").write_bytes(rnd.randbytes(rnd.randrange(1, 3 << 20)))
    with cluster1(tmp_path) as c:
        c.import_(src, "up")
        mnt = c.mount("up")
        yield c, src, mnt


class Readers:
    """``n`` threads reading random files of ``mnt`` with O_DIRECT and checking every
    byte against the source's digest; counts errors, wrong files and the longest read."""

    def __init__(self, src: Path, mnt: Path, n: int = 8) -> None:
        self.files = sorted(p.relative_to(src) for p in src.rglob("*.bin"))
        self.digest = {p: hashlib.sha256((src / p).read_bytes()).digest() for p in self.files}
        self.mnt = mnt
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.wrong = 0
        self.reads = 0
        self.longest = 0.0
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(n)]

    def _run(self, seed: int) -> None:
        rnd = __import__("random").Random(seed)
        buf = mmap.mmap(-1, READ)                       # page-aligned, as O_DIRECT needs
        while not self.stop.is_set():
            rel = rnd.choice(self.files)
            h = hashlib.sha256()
            try:
                fd = os.open(self.mnt / rel, os.O_RDONLY | os.O_DIRECT)
                try:
                    off = 0
                    while True:
                        t0 = time.monotonic()
                        n = os.preadv(fd, [buf], off)
                        self.longest = max(self.longest, time.monotonic() - t0)
                        if n == 0:
                            break
                        h.update(buf[:n])
                        off += n
                        self.reads += 1
                finally:
                    os.close(fd)
            except OSError as e:
                self.errors.append(f"{rel}: {e}")
                continue
            if h.digest() != self.digest[rel]:
                self.wrong += 1

    def __enter__(self) -> "Readers":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=30)
        assert not any(t.is_alive() for t in self.threads), "a reader hung"


def _upgrade(c: Cluster1, mnt: Path, *extra: str) -> "subprocess.CompletedProcess[str]":
    return kspeedfs(["mount", "up", str(mnt), "--upgrade", *extra, *c.common()], check=False)


def test_upgrade_five_times_under_readers_loses_no_read(served) -> None:
    c, src, mnt = served
    with Readers(src, mnt) as readers:
        time.sleep(1.0)
        pids = [daemon_pid(mnt)]
        for _ in range(5):
            before = readers.reads
            r = _upgrade(c, mnt)
            assert r.returncode == 0, r.stderr
            deadline = time.monotonic() + 10
            while daemon_pid(mnt) == pids[-1] and time.monotonic() < deadline:
                time.sleep(0.05)                       # the old daemon exits after handing over
            pids.append(daemon_pid(mnt))
            time.sleep(0.5)
            assert readers.reads > before              # reads went on through the upgrade
    assert readers.errors == [], readers.errors[:5]
    assert readers.wrong == 0
    assert len(set(pids)) == 6 and None not in pids    # a new daemon each time, the old gone
    assert is_mounted(mnt)
    log = c.log_text()
    assert log.count("upgrade: took") == 5 and "Traceback" not in log
    print(f"\n{readers.reads} reads of 128 KiB through 5 upgrades, longest {readers.longest * 1e3:.0f} ms")


def test_upgrade_refuses_another_version_and_the_mount_goes_on(served) -> None:
    c, src, mnt = served
    (src / "d" / "new.bin").write_bytes(b"v2")
    c.import_(src, "up")                               # version 2 is current now
    r = _upgrade(c, mnt)                               # asks for the current version: 2
    assert r.returncode != 0
    assert "serves up@1, not up@2" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    with Readers(src, mnt, n=2) as readers:           # the old daemon still serves v1
        readers.files.remove(Path("d/new.bin"))
        time.sleep(0.5)
    assert readers.reads > 0 and readers.errors == [] and readers.wrong == 0
    assert _upgrade(c, mnt, "--version", "1").returncode == 0


def test_upgrade_of_a_path_nothing_serves_is_one_clear_error(tmp_path: Path, served) -> None:
    c, _, _ = served
    empty = tmp_path / "empty"
    empty.mkdir()
    r = _upgrade(c, empty)
    assert r.returncode != 0 and "is not mounted" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
