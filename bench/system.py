"""The machine under the benchmarks: page cache, mounts, child processes, fio.

Everything that touches the system from the suite goes through here, so the cleanup
guarantees live in one place: every mount is registered in a :class:`Mounts` the
moment it exists, and ``Mounts.close()`` (run from a ``finally`` and on SIGTERM)
unmounts it and reaps its daemon, escalating to ``fusermount3 -uz`` and SIGKILL.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent
FIO_DIR = Path(__file__).resolve().parent / "fio"


def drop_caches() -> None:
    """Drop clean page cache, dentries and inodes (also a FUSE mount's cached pages)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
    except OSError as e:     # not root: the "cold" figures are then warm; say so once
        log.warning("cannot drop caches (%s): cold runs will not be cold", e.strerror)


def is_mounted(path: Path) -> bool:
    target = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == target for line in f)


def wait_mounted(path: Path, proc: subprocess.Popen[bytes] | None, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not is_mounted(path):
        if proc is not None and proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
            argv0 = cast("list[str]", proc.args)[0]      # started from an argv list
            raise RuntimeError(f"{argv0} exited {proc.returncode} before mounting {path}: {err}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} not mounted after {timeout:.0f}s")
        time.sleep(0.05)


def unmount(path: Path, pid: int | None, timeout: float = 15.0) -> None:
    if is_mounted(path):
        r = subprocess.run(["fusermount3", "-u", str(path)], capture_output=True)
        if r.returncode and is_mounted(path):
            subprocess.run(["fusermount3", "-uz", str(path)], capture_output=True)
    deadline = time.monotonic() + timeout
    while pid and time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                return
        except ChildProcessError:        # not our child (a daemonized kspeedfs)
            if not _alive(pid):
                return
        time.sleep(0.05)
    if pid:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for init to reap it counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Mounts:
    """Every mount the suite made, with the pid serving it; closed in reverse order."""

    def __init__(self) -> None:
        self._live: list[tuple[Path, Callable[[], int | None]]] = []

    def add(self, path: Path, pid: Callable[[], int | None]) -> None:
        self._live.append((path, pid))

    def remove(self, path: Path) -> None:
        for item in list(self._live):
            if item[0] == path:
                self._live.remove(item)
                unmount(path, item[1]())

    def close(self) -> None:
        while self._live:
            path, pid = self._live.pop()
            try:
                unmount(path, pid())
            except Exception as e:      # keep going: the next mount must still go
                log.error("unmounting %s: %s", path, e)


def _processes() -> Iterator[tuple[int, list[bytes]]]:
    """(pid, argv) of every process."""
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                yield int(d.name), (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue


def daemon_pid(mountpoint: Path) -> int | None:
    """The kspeedfs daemon serving ``mountpoint`` (it daemonizes, so not our child)."""
    want = str(mountpoint).encode()
    return next((pid for pid, argv in _processes()
                 if b"kspeedfs.cli.app" in b" ".join(argv) and b"mount" in argv and want in argv), None)


def supervisor_pid(mountpoint: Path) -> int | None:
    """The supervisor a daemonized native mount leaves behind (kspeedfs/fuse/supervisor.py)."""
    want = str(mountpoint).encode()
    return next((pid for pid, argv in _processes()
                 if b"kspeedfs.fuse.supervisor" in argv and want in argv), None)


def _stat_cpu(stat: Path) -> tuple[str, float]:
    """(name, CPU seconds: user + system) from a /proc ``stat`` file of a process or
    thread; OSError when it is gone."""
    name, rest = stat.read_text().split("(", 1)[1].rsplit(")", 1)
    fields = rest.split()
    return name, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime, stime


def process_cpu(pid: int | None) -> float | None:
    """CPU seconds (user + system, every thread) a live process has used, or None."""
    if pid is None:
        return None
    try:
        return _stat_cpu(Path(f"/proc/{pid}/stat"))[1]
    except OSError:
        return None


#: native threads by role (their names, set in native/*.c): the soft provider's engine
#: does what an RDMA NIC does in hardware (TCP receive into registered memory)
NIC_THREADS = ("ks-soft-nic",)


def nic_seconds(threads: dict[str, float]) -> float:
    """The soft NIC threads' share of ``thread_cpu``'s seconds."""
    return sum(threads.get(n, 0.0) for n in NIC_THREADS)

#: the native engine's other threads, by role: its request threads (/dev/fuse or io_uring
#: queues: hits answered in C) and the chunk fetch's (verification, the READs parked on a
#: landing chunk); the suite prints each role's CPU per GB beside the main thread's
ROLE_THREADS = {"request threads": ("ks-fuse", "ks-fuse-uring"), "fetch": ("ks-fetch",)}


def role_key(role: str) -> str:
    """The figure a role of :data:`ROLE_THREADS` is recorded under in results.json."""
    return f"daemon_{role.replace(' ', '_')}_cpu_s_per_GB"

#: the key of the process's main thread in ``thread_cpu``: a kspeedfs mount's trio loop
#: (every request of the pyfuse3 engine; the native engine's misses, loads and vQP monitors)
MAIN_THREAD = "main thread"


def thread_cpu(pid: int | None) -> dict[str, float]:
    """CPU seconds (user + system) of a live process's threads, summed by thread name;
    the main thread under :data:`MAIN_THREAD`, not its name."""
    out: dict[str, float] = {}
    if pid is None:
        return out
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return out
    for t in tasks:
        try:
            name, cpu = _stat_cpu(t / "stat")
        except (OSError, IndexError, ValueError):
            continue                            # the thread ended meanwhile
        if t.name == str(pid):
            name = MAIN_THREAD
        out[name] = out.get(name, 0.0) + cpu
    return out


def mem_available() -> int:
    """Bytes the kernel says can be had without swapping (MemAvailable)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def fresh_memory_rate(size: int = 128 << 20) -> float:
    """GB/s at which this process can touch memory it has not touched before (anonymous,
    one write per 4 KiB page, then unmapped). On bare metal a page fault costs well under
    a microsecond; in a VM whose host backs guest memory lazily it can cost tens: this VM
    touched 2 GiB at 1.1 GB/s alone and at 0.10 GB/s with 6 GB held by other processes,
    huge pages or not. A cold kspeedfs mount allocates its memory tier and the mount's
    page cache during the measured run, so its figure follows this rate."""
    import mmap

    m = mmap.mmap(-1, size)
    try:
        t0 = time.perf_counter()
        for off in range(0, size, 4096):
            m[off] = 1
        return size / (time.perf_counter() - t0) / 1e9
    finally:
        m.close()


def machine_cpu() -> float:
    """CPU seconds every CPU of the machine has spent busy (not idle or iowait) since
    boot: the delta over a case is the whole cost of serving it, readers, daemons,
    peers and the kernel's network stack included."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    ticks = [int(x) for x in fields[:8]]          # user nice system idle iowait irq softirq steal
    busy = sum(ticks) - ticks[3] - ticks[4] - ticks[7]
    return busy / os.sysconf("SC_CLK_TCK")


def run_fio(job: str, env: dict[str, str], extra: Sequence[str] = ()) -> dict[str, Any]:
    """Run ``bench/fio/<job>`` read-only; the summed read figures of all jobs."""
    cmd = ["fio", "--readonly", "--output-format=json", *extra, str(FIO_DIR / job)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env}, timeout=1800)
    if proc.returncode:
        raise RuntimeError(f"fio {job} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    out = proc.stdout
    data = json.loads(out[out.index("{"):])        # fio may print notes before the JSON
    read = data["jobs"][0]["read"]                 # group_reporting: one summed job
    return {"bytes": read["io_bytes"], "seconds": read["runtime"] / 1000.0,
            "MB/s": read["bw_bytes"] / 1e6, "IOPS": read["iops"], "ios": read.get("total_ios", 0),
            "lat_p99_us": read.get("clat_ns", {}).get("percentile", {}).get("99.000000", 0) / 1000.0}

