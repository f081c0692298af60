"""A mount's daemon replaced under its readers: upgraded (``kspeedfs mount --upgrade``,
fuse/upgrade.py: the new daemon takes the /dev/fuse connection over, the old one stops
reading and exits) or SIGKILLed (fuse/supervisor.py: the supervisor holds the
connection's fds, starts a daemon that resumes them, FUSE_NOTIFY_RESEND re-queues what
the dead one held). Readers go through the daemon the whole time (O_DIRECT: every read
is a FUSE READ, not a page-cache hit) and see at most a pause — no error, no wrong
byte, no hung reader."""
from __future__ import annotations

import errno
import hashlib
import mmap
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from bench.system import supervisor_pid
from tests.fixtures.mounts import Cluster1, cluster1, daemon_pid, is_mounted, kspeedfs

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or os.environ.get("KSPEEDFS_FUSE_ENGINE") == "pyfuse3",
    reason="an upgrade hands over a native-engine connection (root, fuse.engine=native)")

READ = 128 << 10
#: upgrade and resume hand a /dev/fuse connection over; an io_uring mount refuses both
#: (fuse/native.py RING_LIFECYCLE, tests/mount/test_io_uring.py), so these mounts say off
#: even in the io_uring lane (KSPEEDFS_FUSE_IO_URING=auto)
DEV_FUSE = ("--set", "fuse.io_uring=off")


@pytest.fixture
def served(tmp_path: Path):
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    rnd = __import__("random").Random(3)
    for i in range(24):
        (src / "d" / f"f{i:02d}.bin").write_bytes(rnd.randbytes(rnd.randrange(1, 3 << 20)))
    with cluster1(tmp_path) as c:
        c.import_(src, "up")
        mnt = c.mount("up", None, *DEV_FUSE)
        yield c, src, mnt


class Readers:
    """``n`` threads reading random files of ``mnt`` with O_DIRECT and checking every
    byte against the source's digest; counts errors, wrong files and the longest read."""

    def __init__(self, src: Path, mnt: Path, n: int = 8, without: Path | None = None) -> None:
        # ``without``: a file the mount does not serve, left out before any reader starts
        # (removed after the start, a reader could already have picked it: ENOENT)
        self.files = sorted(p.relative_to(src) for p in src.rglob("*.bin") if
                            p.relative_to(src) != without)
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

    def __enter__(self) -> Readers:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=30)
        assert not any(t.is_alive() for t in self.threads), "a reader hung"


def _upgrade(c: Cluster1, mnt: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return kspeedfs(["mount", "up", str(mnt), "--upgrade", *extra, *c.common()], check=False)


def _successor(mnt: Path, old: int | None) -> int | None:
    """The daemon serving ``mnt`` once ``old`` has handed over and exited (waits up to
    10 s; ``old`` itself if it never left)."""
    deadline = time.monotonic() + 10
    while daemon_pid(mnt) == old and time.monotonic() < deadline:
        time.sleep(0.05)
    return daemon_pid(mnt)


def test_upgrade_five_times_under_readers_loses_no_read(served) -> None:
    c, src, mnt = served
    with Readers(src, mnt) as readers:
        time.sleep(1.0)
        pids = [daemon_pid(mnt)]
        for _ in range(5):
            before = readers.reads
            r = _upgrade(c, mnt)
            assert r.returncode == 0, r.stderr
            pids.append(_successor(mnt, pids[-1]))
            time.sleep(0.5)
            assert readers.reads > before              # reads went on through the upgrade
    assert readers.errors == [], readers.errors[:5]
    assert readers.wrong == 0
    assert len(set(pids)) == 6 and None not in pids    # a new daemon each time, the old gone
    assert is_mounted(mnt)
    log = c.log_text()
    assert log.count("upgrade: took") == 5 and "Traceback" not in log
    print(f"\n{readers.reads} reads of 128 KiB through 5 upgrades, longest {readers.longest * 1e3:.0f} ms")


def test_upgrade_under_one_stream_read_alone_loses_no_read(served) -> None:
    """One reader, one handle read over and over with O_DIRECT, nothing else: the
    handle the kernel holds is the old daemon's, and after each upgrade the new one
    serves it with every byte right (the other tests read many files, opening each)."""
    c, src, mnt = served
    rel = max((p.relative_to(src) for p in src.rglob("*.bin")), key=lambda p: (src / p).stat().st_size)
    want = (src / rel).read_bytes()
    buf = mmap.mmap(-1, READ)
    stop = threading.Event()
    reads, errors = [0], []

    def stream() -> None:
        fd = os.open(mnt / rel, os.O_RDONLY | os.O_DIRECT)
        try:
            while not stop.is_set():
                for off in range(0, len(want), READ):
                    n = os.preadv(fd, [buf], off)
                    if buf[:n] != want[off:off + READ]:
                        errors.append(f"{rel} at {off}: wrong bytes")
                    reads[0] += 1
        except OSError as e:
            errors.append(f"{rel}: {e}")
        finally:
            os.close(fd)

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    try:
        for _ in range(3):
            time.sleep(0.5)                            # well past the one-stream spell
            before, old = reads[0], daemon_pid(mnt)
            r = _upgrade(c, mnt)
            assert r.returncode == 0, r.stderr
            assert _successor(mnt, old) not in (old, None)   # the old one handed over and left
            time.sleep(0.3)
            assert reads[0] > before
    finally:
        stop.set()
        t.join(timeout=30)
    assert not t.is_alive(), "the reader hung"
    assert errors == [], errors[:5]
    assert "upgrade: took" in c.log_text()


def test_daemon_sigkilled_five_times_under_readers_loses_no_read(served) -> None:
    c, src, mnt = served
    sup = supervisor_pid(mnt)
    assert sup is not None
    with Readers(src, mnt) as readers:
        time.sleep(1.0)
        for i in range(5):
            pid = daemon_pid(mnt)
            before = readers.reads
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 20
            while daemon_pid(mnt) in (pid, None) and time.monotonic() < deadline:
                time.sleep(0.05)                       # the supervisor starts a new one
            assert daemon_pid(mnt) not in (pid, None), "no daemon after the crash"
            # each kill hits a daemon that has finished taking over (it serves from its
            # adopt on, and logs "resume: took" after the supervisor's answer: under ASan
            # that took over a second, and a kill in between left the line unlogged)
            deadline = time.monotonic() + 30
            while c.log_text().count("resume: took") < i + 1 and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(1.0)
            assert readers.reads > before
    assert readers.errors == [], readers.errors[:5]
    assert readers.wrong == 0
    assert is_mounted(mnt) and supervisor_pid(mnt) == sup   # one supervisor throughout
    log = c.log_text()
    assert log.count("resume: took") == 5 and "Traceback" not in log
    resent = sum(int(m) for m in re.findall(r"resume: answered (\d+) requests", log))
    print(f"\n{readers.reads} reads of 128 KiB through 5 SIGKILLs, longest "
          f"{readers.longest * 1e3:.0f} ms, {resent} requests answered after a resend")


#: how long a killed supervisor may take to be replaced by its daemon (s): the daemon sees
#: its control socket close at once; the rest is a Python process starting (ASan lane too)
NEW_SUPERVISOR_WITHIN = 10.0


def _wait_log(c: Cluster1, needle: str, count: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while c.log_text().count(needle) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    assert c.log_text().count(needle) >= count, f"{needle!r} < {count}:\n{c.log_text()[-2000:]}"


def _supervisor_replaced(c: Cluster1, mnt: Path, old: int) -> tuple[int, float]:
    """SIGKILL supervisor ``old`` of ``mnt``; the new one the daemon starts and how long it
    took to appear, once it holds the connection's fds (its "supervising" line)."""
    holding = c.log_text().count("supervising ")
    t0 = time.monotonic()
    os.kill(old, signal.SIGKILL)
    while supervisor_pid(mnt) in (old, None) and time.monotonic() < t0 + NEW_SUPERVISOR_WITHIN:
        time.sleep(0.02)
    took = time.monotonic() - t0
    new = supervisor_pid(mnt)
    assert new not in (old, None), f"no new supervisor in {NEW_SUPERVISOR_WITHIN} s"
    _wait_log(c, "supervising ", holding + 1)
    return new, took


def test_a_supervisor_killed_then_its_daemon_killed_loses_no_read(served) -> None:
    """The double fault, twice: the supervisor SIGKILLed (its daemon starts a new one and
    hands it the fds and the sealed manifest copy, as at its mount), then the daemon
    SIGKILLed under readers verifying every byte: the new supervisor resumes the
    connection and the reads go on. The second round hits a resumed daemon, which hands
    on the copy it was started with (both resumes load the manifest from it)."""
    c, src, mnt = served
    sup = supervisor_pid(mnt)
    assert sup is not None
    appeared = []
    with Readers(src, mnt) as readers:
        time.sleep(0.5)
        for i in range(2):
            sup, took = _supervisor_replaced(c, mnt, sup)
            appeared.append(took)
            time.sleep(0.3)
            pid, before = daemon_pid(mnt), readers.reads
            os.kill(pid, signal.SIGKILL)
            _wait_log(c, "resume: took", i + 1)
            time.sleep(0.5)
            assert readers.reads > before, "no read after the daemon was killed"
            assert daemon_pid(mnt) not in (pid, None) and supervisor_pid(mnt) == sup
    assert readers.errors == [], readers.errors[:5]
    assert readers.wrong == 0 and is_mounted(mnt)
    log = c.log_text()
    assert log.count("is gone: starting a new one") == 2, log[-2000:]
    assert log.count("the manifest from the supervisor's sealed copy") == 2
    assert "Traceback" not in log and "giving up" not in log
    print(f"\n{readers.reads} reads of 128 KiB through 2 supervisor + 2 daemon SIGKILLs, "
          f"new supervisor after {', '.join(f'{t * 1e3:.0f}' for t in appeared)} ms, "
          f"longest read {readers.longest * 1e3:.0f} ms")


def _cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


def _environ(pid: int) -> bytes:
    return Path(f"/proc/{pid}/environ").read_bytes()


def test_a_password_given_on_the_command_line_is_in_no_respawned_argv(served) -> None:
    """``--set store.etcd_password=…`` warns in one line, and the supervisor, the daemon
    it resumes and a supervisor started again carry it in their environment (root-only
    /proc/PID/environ), never in their command line (every user's ``ps``)."""
    c, _, _ = served
    password = "pw-" + os.urandom(12).hex()
    mnt = c.base / "mnt-secret"
    mnt.mkdir()
    c.mounts.append(mnt)
    r = kspeedfs(["mount", "up", str(mnt), *DEV_FUSE, "-o", f"ro,store.etcd_password={password}",
                  *c.common()])
    warned = [line for line in r.stderr.splitlines() if "store.etcd_password" in line]
    assert len(warned) == 1 and "store.etcd_password_file" in warned[0], r.stderr
    assert password not in r.stderr
    want = f"KSPEEDFS_STORE_ETCD_PASSWORD={password}".encode()
    sup = supervisor_pid(mnt)
    assert sup is not None and password.encode() not in _cmdline(sup)
    assert want in _environ(sup).split(b"\0")
    pid = daemon_pid(mnt)
    os.kill(pid, signal.SIGKILL)
    _wait_log(c, "resume: took", 1)
    resumed = daemon_pid(mnt)
    assert resumed not in (pid, None)
    assert password.encode() not in _cmdline(resumed) and want in _environ(resumed).split(b"\0")
    new, _ = _supervisor_replaced(c, mnt, sup)
    assert password.encode() not in _cmdline(new) and want in _environ(new).split(b"\0")
    assert (mnt / "d" / "f00.bin").read_bytes() == (c.base / "src" / "d" / "f00.bin").read_bytes()


def _killed_and_resumed(c: Cluster1, mnt: Path, readers: Readers) -> int:
    """SIGKILL ``mnt``'s daemon under ``readers``; its pid, once a new daemon took the
    connection over and the reads went on."""
    time.sleep(0.5)
    pid = daemon_pid(mnt)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while "resume: took" not in c.log_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    before = readers.reads
    time.sleep(0.5)
    assert readers.reads > before, "no read after the crash"
    return pid


def test_a_daemon_killed_after_a_new_version_was_imported_resumes_the_old_one(served) -> None:
    """The dataset imported again (version 2 current) while version 1 is mounted, then the
    daemon SIGKILLed: the daemon the supervisor starts serves version 1, the one the
    connection's inodes belong to, and the readers go on. (Its argv names no version: it
    asked for the current one, the takeover refused 2 for a connection serving 1, and
    after ``fuse.resume_patience`` the mount was dead.)"""
    c, src, mnt = served
    (src / "d" / "new.bin").write_bytes(b"v2")
    c.import_(src, "up")                               # version 2 is current now
    with Readers(src, mnt, n=2, without=Path("d/new.bin")) as readers:
        pid = _killed_and_resumed(c, mnt, readers)
    assert readers.errors == [] and readers.wrong == 0, readers.errors[:5]
    assert daemon_pid(mnt) not in (pid, None) and not (mnt / "d" / "new.bin").exists()
    assert os.getxattr(mnt, "user.kspeedfs.dataset") == b"up@1"


def test_a_daemon_killed_while_its_store_is_gone_resumes_from_the_supervisors_copy(
        served) -> None:
    """The store's directory moved away (as etcd down, or the version removed), then the
    daemon SIGKILLed: the new daemon loads the manifest from the supervisor's sealed copy
    (manifest/sealed.py), not the store, and the readers go on. (Loaded from the store,
    each new daemon failed, and after ``fuse.resume_patience`` the mount was dead.)"""
    c, src, mnt = served
    c.store.rename(c.store.with_name("store-moved"))
    with Readers(src, mnt, n=2) as readers:
        pid = _killed_and_resumed(c, mnt, readers)
    assert readers.errors == [] and readers.wrong == 0, readers.errors[:5]
    assert daemon_pid(mnt) not in (pid, None)
    log = c.log_text()
    assert "the manifest from the supervisor's sealed copy" in log, log[-2000:]
    assert "exited (status" not in log and "Traceback" not in log


def test_a_daemon_that_cannot_start_again_leaves_the_mount_failing_not_hung(served) -> None:
    """The daemon SIGKILLed while no new one can start (its source moved away): each
    daemon the supervisor starts exits before taking the connection; after
    ``fuse.resume_patience`` (3 s here) it gives up and a reader gets an error. (Before, it
    waited 60 s for each such daemon to call and retried for ever: readers hung.)"""
    c, src, _ = served
    mnt = c.mount("up", None, *DEV_FUSE, "--set", "fuse.resume_patience=3")
    assert supervisor_pid(mnt) is not None
    src.rename(src.with_name("src-moved"))
    t0 = time.monotonic()
    os.kill(daemon_pid(mnt), signal.SIGKILL)
    deadline = t0 + 60
    while supervisor_pid(mnt) is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    took = time.monotonic() - t0
    assert supervisor_pid(mnt) is None, "the supervisor is still trying"
    with pytest.raises(OSError) as e:
        os.stat(mnt / "d" / "f00.bin")
    # ENOTCONN, or ECONNABORTED for a request the kernel held as the supervisor's fds
    # closed (an exiting process has no command line in /proc for ``supervisor_pid``
    # while its fds close: the ASan lane saw it once)
    assert e.value.errno in (errno.ENOTCONN, errno.ECONNABORTED), e.value
    log = c.log_text()
    assert log.count("exited (status") >= 2 and "giving up" in log, log[-2000:]
    assert took < 20, took
    print(f"\ngave up after {took:.1f} s, {log.count('exited (status')} daemons tried")


def test_supervisor_leaves_with_its_mount(served) -> None:
    c, _, mnt = served
    sup = supervisor_pid(mnt)
    assert sup is not None
    kspeedfs(["umount", str(mnt)])
    # a bound for "it leaves", not a figure: on a 2-core host at load 15 the daemon took
    # 12 s from the unmount to its "bye", with or without a supervisor watch
    deadline = time.monotonic() + 30
    while supervisor_pid(mnt) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert supervisor_pid(mnt) is None and not is_mounted(mnt)
    assert "ended cleanly (unmounted)" in c.log_text()


def test_upgrade_after_a_reimport_takes_over_the_served_version_and_refuses_another(
        served) -> None:
    """Version 2 imported while 1 is mounted: an upgrade that names no version takes
    version 1 over, the one the mount serves (it asked for the current one and was
    refused: ``systemctl reload`` after a re-import failed); one that asks for 2 is
    refused in one line and the old daemon goes on serving."""
    c, src, mnt = served
    (src / "d" / "new.bin").write_bytes(b"v2")
    c.import_(src, "up")                               # version 2 is current now
    r = _upgrade(c, mnt, "--version", "2")
    assert r.returncode != 0
    assert "serves up@1, not up@2" in r.stderr and "Traceback" not in r.stderr
    assert "ExceptionGroup" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    with Readers(src, mnt, n=2, without=Path("d/new.bin")) as readers:   # v1 throughout
        old = daemon_pid(mnt)
        r = _upgrade(c, mnt)
        assert r.returncode == 0, r.stderr
        assert _successor(mnt, old) not in (old, None)
        time.sleep(0.5)
    assert readers.reads > 0 and readers.errors == [] and readers.wrong == 0
    assert not (mnt / "d" / "new.bin").exists()        # still version 1's tree
    assert "upgrade: took" in c.log_text()


def test_a_mount_point_too_long_to_name_a_socket_after_is_served_and_upgraded(
        tmp_path: Path) -> None:
    """The handover socket and the log file are named after the mount point, shortened
    when the name would not fit an AF_UNIX address or a file name (mountpoint.name_for):
    such a mount point used to kill its daemon right after mounting."""
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / "f.bin").write_bytes(os.urandom(3 << 20))
    with cluster1(tmp_path) as c:
        c.import_(src, "up")
        mnt = tmp_path / ("a-mount-point-with-a-long-name-" * 3) / ("b" * 100) / ("c" * 100)
        mnt.parent.mkdir(parents=True)                  # its log's name would be 300-odd
        c.mount("up", mnt, *DEV_FUSE)
        old = daemon_pid(mnt)
        with Readers(src, mnt, n=2) as readers:
            time.sleep(0.3)
            assert _upgrade(c, mnt).returncode == 0
            time.sleep(0.3)
        assert daemon_pid(mnt) not in (None, old)
        assert readers.reads > 0 and readers.errors == [] and readers.wrong == 0
        assert "cannot be upgraded in place" not in c.log_text()


def test_upgrade_reaches_only_the_daemon_of_its_own_mount_point(tmp_path: Path, served) -> None:
    """``/…/a_b`` and ``/…/a/b`` once shared a handover socket name, and the second
    mount's daemon listened on it: an upgrade of the first was refused. Each has its own
    now: the upgrade of the first takes the first's connection, the second serves on."""
    c, _, _ = served
    (tmp_path / "a").mkdir()
    first, second = tmp_path / "a_b", tmp_path / "a" / "b"
    c.mount("up", first, *DEV_FUSE)
    c.mount("up", second, *DEV_FUSE)
    old, pid = daemon_pid(first), daemon_pid(second)
    r = _upgrade(c, first)
    assert r.returncode == 0, r.stderr
    assert _successor(first, old) not in (old, None)
    assert daemon_pid(second) == pid and is_mounted(first) and is_mounted(second)


def test_upgrade_of_a_path_nothing_serves_is_one_clear_error(tmp_path: Path, served) -> None:
    c, _, _ = served
    empty = tmp_path / "empty"
    empty.mkdir()
    r = _upgrade(c, empty)
    assert r.returncode != 0 and "is not mounted" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_requests_a_killed_daemon_held_are_answered_after_resend(tmp_path: Path) -> None:
    """Deterministic FUSE_NOTIFY_RESEND: the source is a FUSE mount (bench/ramfs_py.py)
    that is SIGSTOPped, so cold reads are held by the kspeedfs daemon (read from
    /dev/fuse, waiting on the source) when it is SIGKILLed; after the resume the kernel
    sends them again and the readers get their bytes."""
    import subprocess
    import sys

    from bench.system import unmount, wait_mounted

    src = tmp_path / "src"
    src.mkdir()
    rnd = __import__("random").Random(5)
    data = {f"f{i}.bin": rnd.randbytes(300_000) for i in range(4)}
    for name, b in data.items():
        (src / name).write_bytes(b)
    slow = tmp_path / "slow"
    slow.mkdir()
    ramfs_py = Path(__file__).resolve().parents[2] / "bench" / "ramfs_py.py"
    ramfs = subprocess.Popen([sys.executable, str(ramfs_py), str(src), str(slow)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_mounted(slow, ramfs, timeout=30)
        with cluster1(tmp_path) as c:
            c.import_(slow, "held")
            mnt = c.mount("held", None, *DEV_FUSE)
            got: dict[str, bytes | str] = {}

            def read(name: str) -> None:
                try:
                    got[name] = (mnt / name).read_bytes()
                except OSError as e:
                    got[name] = str(e)

            os.kill(ramfs.pid, signal.SIGSTOP)         # the source hangs: misses wait on it
            threads = [threading.Thread(target=read, args=(n,), daemon=True) for n in data]
            for t in threads:
                t.start()
            time.sleep(1.0)                            # read by the daemon, now held there
            os.kill(daemon_pid(mnt), signal.SIGKILL)
            time.sleep(0.5)
            os.kill(ramfs.pid, signal.SIGCONT)
            for t in threads:
                t.join(timeout=30)
            assert not any(t.is_alive() for t in threads), "a reader hung"
            assert got == data
            deadline = time.monotonic() + 10
            while "resume: answered" not in c.log_text() and time.monotonic() < deadline:
                time.sleep(0.1)
            resent = re.search(r"resume: answered (\d+) requests", c.log_text())
            assert resent and int(resent.group(1)) >= 1, c.log_text()[-2000:]
    finally:
        os.kill(ramfs.pid, signal.SIGCONT)
        unmount(slow, ramfs.pid)
        ramfs.wait(timeout=10)


def test_reload_as_systemd_runs_it_hands_the_unit_to_the_new_daemon(tmp_path: Path) -> None:
    """mount/kspeedfs@.service: ExecStart runs the mount in the foreground (Type=notify),
    ExecReload runs ``--upgrade``; the new daemon must report itself as the unit's main
    process (MAINPID=) and the foreground one exit 0. Played here with a NOTIFY_SOCKET of
    our own (no systemd in the test machine)."""
    import socket
    import subprocess

    from tests.fixtures.mounts import KSPEEDFS

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(os.urandom(100_000))
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify"))
    notify.settimeout(60)
    env = {**os.environ, "NOTIFY_SOCKET": str(tmp_path / "notify")}
    with cluster1(tmp_path) as c:
        c.import_(src, "unit")
        mnt = tmp_path / "mnt"
        mnt.mkdir()
        c.mounts.append(mnt)
        main = subprocess.Popen([*KSPEEDFS, "mount", "unit", str(mnt), "--foreground", *DEV_FUSE,
                                 *c.common()],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            assert notify.recv(256).decode() == f"MAINPID={main.pid}\nREADY=1"
            r = subprocess.run([*KSPEEDFS, "mount", "unit", str(mnt), "--upgrade", *c.common()],
                               env=env, capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, r.stderr
            msg = notify.recv(256).decode()
            assert main.wait(timeout=30) == 0                  # handed over, exits cleanly
            assert msg == f"MAINPID={daemon_pid(mnt)}\nREADY=1"
            assert (mnt / "a.bin").read_bytes() == (src / "a.bin").read_bytes()
        finally:
            notify.close()
            if main.poll() is None:
                main.kill()
