"""What a workload runs against: kspeedfs and its baselines, each in a named state.

=========================  ==========================================================  =====================
target                     state before every measured run                             ceiling of
=========================  ==========================================================  =====================
``source-cold``            the source directory; page cache dropped                    the disk
``source-warm``            the source directory; every file read just before           the page cache
``kspeedfs-cold``          a fresh mount (empty chunk cache); page cache dropped       (kspeedfs, first epoch)
``kspeedfs-warm``          a mount whose chunk cache holds the dataset; page cache     (kspeedfs, later epochs
                           dropped: every byte crosses FUSE and the daemon             evicted from the kernel)
``pyfuse3:kspeedfs-cold``  kspeedfs-cold with ``fuse.engine=pyfuse3`` (the old         (the pyfuse3 engine,
                           single-Python-thread engine)                                first epoch)
``pyfuse3:kspeedfs-warm``  kspeedfs-warm with ``fuse.engine=pyfuse3``                  (the pyfuse3 engine,
                                                                                       later epochs)
``io_uring:kspeedfs-warm`` kspeedfs-warm with ``fuse.io_uring=auto``, mounted while    (the native engine over
                           the fuse module's ``enable_uring`` is Y (set for the mount,  FUSE io_uring queues)
                           then put back): requests through per-CPU io_uring queues
``ramfs-py``               bench/ramfs_py.py, bytes preloaded; page cache dropped      a Python FUSE daemon
``ramfs-c``                bench/ramfs_c.c (libfuse3 low level, single-threaded        any FUSE daemon
                           loop); page cache dropped
``ramfs-c-mt``             bench/ramfs_c.c, libfuse's multi-threaded loop: one worker  a multi-threaded FUSE
                           per CPU, a cloned /dev/fuse fd each (``RAMFS_C_THREADS``,   daemon
                           ``RAMFS_C_CLONE_FD``); page cache dropped
=========================  ==========================================================  =====================

``kspeedfs-*`` run the configured default engine (``fuse.engine``: native, C request
threads answering metadata and memory-tier hits). The metadata workloads (stat, ls-l)
mount one warm, unpreloaded ``kspeedfs`` without xattrs and its ``pyfuse3:kspeedfs``
twin instead of the cold/warm pairs.

All FUSE targets get the same mount options family (``ro``, default_permissions),
keep_cache, day-long entry/attr timeouts and the same sysfs knobs
(``kspeedfs.fuse.tuning`` with kspeedfs's configured values), so differences are
the daemons, not the kernel settings - except the request size: the native engine
negotiates ``fuse.max_pages`` at INIT (256 pages, 1 MiB READs, by default), the
pyfuse3 engine gets the kernel default (32).

A target is set up once per workload (``setup``), put in its state before every
measured run (``prepare``), and torn down by the suite's :class:`~bench.system.Mounts`.
"""  # noqa: E501 - an RST table, read as one
from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from .datasets import Dataset
from .readers import read_paths
from .system import Mounts, daemon_pid, drop_caches, unmount, wait_mounted

log = logging.getLogger(__name__)

PY = sys.executable
KSPEEDFS = [PY, "-m", "kspeedfs.cli.app"]


def package_cwd(env: dict[str, str] | None = None) -> str | None:
    """Where to run ``KSPEEDFS``: the first ``PYTHONPATH`` entry (the tree under test).
    ``python -m`` puts its working directory first on ``sys.path``, ahead of
    ``PYTHONPATH``, so from a checkout's directory the checkout's kspeedfs was imported
    and ``--ab-tree``/``--kspeedfs-tree``/``--kspeedfs-rev`` measured the checkout twice."""
    first = (env if env is not None else os.environ).get("PYTHONPATH", "").split(os.pathsep)[0]
    return first or None


BENCH = Path(__file__).resolve().parent


def read_tree(root: Path, paths: Sequence[str]) -> int:
    """Read every file once (warm a cache); returns bytes read."""
    return read_paths(root, paths)


def fuse_knobs(overrides: dict[str, str] | None = None) -> object:
    """kspeedfs's effective FUSE knobs (defaults + overrides), as tuning.KernelKnobs."""
    from kspeedfs import config
    from kspeedfs.fuse import tuning

    cfg = config.load(overrides={k: v for k, v in (overrides or {}).items()}, environ={})
    return tuning.KernelKnobs(cfg.fuse.max_background, cfg.fuse.congestion_threshold,
                              cfg.fuse.read_ahead_kb)


class Target:
    name = "?"
    fuse = False
    #: keeps a copy of the dataset in RAM while its workload runs (the memory check)
    holds_dataset = False

    def __init__(self, ds: Dataset) -> None:
        self.ds = ds
        self.path: Path = ds.root

    def setup(self, mounts: Mounts, work: Path) -> None:
        pass

    def prepare(self) -> None:
        drop_caches()

    def stats(self) -> dict | None:
        return None

    def daemon(self) -> int | None:
        """The process serving this target (a FUSE daemon), whose CPU the suite charges
        to each run; None for targets the kernel serves alone."""
        return None

    def peers(self) -> list[int]:
        """Other processes serving this target's reads (a cluster's nodes): the suite
        charges their soft NIC threads to each run beside the daemon's (the work RDMA
        NICs do in hardware on the far side)."""
        return []

    def finish(self) -> None:
        """After a measured run (the cold kspeedfs mount gives its memory back here)."""


class SourceCold(Target):
    name = "source-cold"


class SourceWarm(Target):
    name = "source-warm"

    def prepare(self) -> None:
        read_tree(self.path, self.ds.paths())


class KspeedfsStore:
    """One embedded store per (dataset, chunk size, block size, manifest format),
    imported once and reused."""

    def __init__(self, work: Path, ds: Dataset, chunk: str = "", block: str = "",
                 whole: bool = False) -> None:
        # the manifest format of the kspeedfs under test (first on sys.path): a revision
        # from before format 2 (block digests) cannot mount a newer store, so formats
        # after 1 get a store of their own
        from kspeedfs.manifest.model import FORMAT_VERSION

        # whole: the manifest kept whole in the store, never paged (manifest/pages.py)
        self.chunk, self.block, self.whole = chunk, block, whole
        tag = ((f"-{chunk}" if chunk else "") + (f"-b{block}" if block else "")
               + (f"-f{FORMAT_VERSION}" if FORMAT_VERSION > 1 else "")
               + ("-whole" if whole else ""))
        self.dir = work / "stores" / f"{ds.root.name}{tag}"
        self.name = "ds"
        self.logs = work / "log"
        self.ds = ds

    def common(self) -> list[str]:
        return ["--store", str(self.dir / "store"), "--set", f"log.dir={self.logs}"]

    def ensure(self) -> None:
        marker = self.dir / ".imported"
        # a tree of several generated parts (the cluster workload's) has no marker of its
        # own: its listing is written once they are all made
        made = self.ds.root / ".complete"
        if not made.exists():
            made = self.ds.listing()
        want = json.dumps({"root": str(self.ds.root), "chunk": self.chunk, "block": self.block,
                           "mtime": os.stat(made).st_mtime_ns})
        if marker.exists() and marker.read_text() == want:
            return
        if self.dir.exists():
            import shutil

            shutil.rmtree(self.dir)
        self.dir.mkdir(parents=True)
        cmd = [*KSPEEDFS, "import", str(self.ds.root), "--name", self.name, "-q", *self.common()]
        if self.chunk:
            cmd += ["--chunk-size", self.chunk]
        if self.block:
            cmd += ["--block-size", self.block]
        if self.whole:
            cmd += ["--set", "store.paged_above=1TiB"]
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=package_cwd())
        if r.returncode:
            raise RuntimeError(f"kspeedfs import failed: {r.stderr.strip()}")
        log.info("%s", r.stdout.strip())
        marker.write_text(want)


class Kspeedfs(Target):
    """kspeedfs through its own CLI, exactly as a user mounts it."""

    preload = True      # warm: read the whole dataset through the mount at setup
    holds_dataset = True    # its memory tier (cold: by the end of a run)

    def __init__(self, ds: Dataset, store: KspeedfsStore, warm: bool,
                 settings: dict[str, str] | None = None, label: str = "",
                 tree: Path | None = None) -> None:
        super().__init__(ds)
        self.store = store
        self.tree = tree          # another kspeedfs source tree (A/B runs), first on PYTHONPATH
        self.warm = warm
        self.settings = dict(settings or {})
        self.name = label or ("kspeedfs-warm" if warm else "kspeedfs-cold")
        self.mounts: Mounts | None = None
        self.mp: Path | None = None
        self._mounted = False

    def _mount_args(self) -> list[str]:
        args = [*KSPEEDFS, "mount", self.store.name, str(self.mp), *self.store.common()]
        if "cache.memory" not in self.settings:
            # a dataset-sized cache: "warm" means every chunk is held
            args += ["--cache-mem", str(max(256 << 20, int(self.ds.bytes * 1.3) + (64 << 20)))]
        if "fuse.xattrs" not in self.settings:
            args += ["--set", "fuse.xattrs=true"]     # the suite records the stats xattr
        for k, v in self.settings.items():
            args += ["--set", f"{k}={v}"]
        return args

    def _mount(self) -> None:
        assert self.mounts is not None and self.mp is not None
        env = None
        if self.tree is not None:
            path = os.pathsep.join([str(self.tree), os.environ.get("PYTHONPATH", "")])
            env = {**os.environ, "PYTHONPATH": path}
        r = subprocess.run(self._mount_args(), capture_output=True, text=True, env=env,
                           cwd=package_cwd(env))
        mp = self.mp
        self.mounts.add(mp, lambda: daemon_pid(mp))
        if r.returncode:
            raise RuntimeError(f"kspeedfs mount failed: {r.stderr.strip()}")
        self._mounted = True

    def _unmount(self) -> None:
        assert self.mounts is not None and self.mp is not None
        self.mounts.remove(self.mp)
        self._mounted = False

    def setup(self, mounts: Mounts, work: Path) -> None:
        self.store.ensure()
        self.mounts = mounts
        self.mp = work / "mnt" / re.sub(r"[^A-Za-z0-9_.=-]+", "_", self.name)
        self.mp.mkdir(parents=True, exist_ok=True)
        if self.warm:
            self._mount()
            if self.preload:
                read_tree(self.mp, self.ds.paths())   # every chunk into the chunk cache
        self.path = self.mp

    def prepare(self) -> None:
        if not self.warm:
            if self._mounted:
                self._unmount()
            self._mount()
        drop_caches()

    def finish(self) -> None:
        if not self.warm and self._mounted:
            self._unmount()

    def daemon(self) -> int | None:
        return daemon_pid(self.mp) if self._mounted and self.mp is not None else None

    def stats(self) -> dict | None:
        if not self._mounted:
            return None
        try:
            return json.loads(os.getxattr(self.path, "user.kspeedfs.stats"))
        except OSError:
            return None


ENABLE_URING = Path("/sys/module/fuse/parameters/enable_uring")


class UringKspeedfs(Kspeedfs):
    """kspeedfs with ``fuse.io_uring=auto``. The kernel offers io_uring at INIT only while
    ``enable_uring`` is Y, and a connection that negotiated it keeps it, so the parameter
    is Y only around each mount and put back at once: the other targets' mounts are the
    same as without this one. The suite checks the mount really runs io_uring queues."""

    def __init__(self, ds: Dataset, store: KspeedfsStore, warm: bool = True) -> None:
        super().__init__(ds, store, warm, settings={"fuse.io_uring": "auto"},
                         label=f"io_uring:kspeedfs-{'warm' if warm else 'cold'}")

    def _mount(self) -> None:
        before = ENABLE_URING.read_text().strip()
        ENABLE_URING.write_text("Y")
        try:
            super()._mount()
        finally:
            ENABLE_URING.write_text(before)
        assert self.mp is not None
        transport = json.loads(os.getxattr(self.mp, "user.kspeedfs.stats")).get("transport")
        if transport != "native io_uring":
            raise RuntimeError(f"{self.name}: the mount serves over {transport!r}, not io_uring")


class RamFS(Target):
    """bench/ramfs_py.py or bench/ramfs_c.c, run in the foreground as our child."""

    holds_dataset = True

    def __init__(self, ds: Dataset, kind: str, binary: Path | None = None,
                 knobs: dict[str, str] | None = None, env: dict[str, str] | None = None,
                 label: str = "") -> None:
        """``env``: extra environment for the daemon (ramfs_c.c reads ``RAMFS_C_THREADS``
        and ``RAMFS_C_CLONE_FD``); ``label``: the target's name (default ``ramfs-KIND``),
        which also names its mountpoint and log, so two instances of one kind need two."""
        super().__init__(ds)
        self.kind = kind
        self.name = label or f"ramfs-{kind}"
        self.binary = binary
        self.knob_overrides = knobs
        self.env = dict(env or {})
        self.proc: subprocess.Popen | None = None

    def setup(self, mounts: Mounts, work: Path) -> None:
        from kspeedfs.fuse import tuning

        mp = work / "mnt" / re.sub(r"[^A-Za-z0-9_.=-]+", "_", self.name)
        mp.mkdir(parents=True, exist_ok=True)
        if self.kind == "py":
            cmd = [PY, str(BENCH / "ramfs_py.py"), str(self.ds.root), str(mp)]
        else:
            assert self.binary is not None
            cmd = [str(self.binary), str(self.ds.root), str(mp)]
        errlog = open(work / "log" / f"{mp.name}.log", "ab")
        env = {**os.environ, **self.env} if self.env else None
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=errlog, stderr=errlog,
                                     env=env)
        proc = self.proc
        mounts.add(mp, lambda: proc.pid if proc.poll() is None else None)
        wait_mounted(mp, self.proc, timeout=1800)
        now = tuning.apply(str(mp), fuse_knobs(self.knob_overrides))
        log.info("%s knobs: %s", self.name, now)
        self.path = mp

    def daemon(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None


def build_ramfs_c(work: Path) -> Path:
    """Compile bench/ramfs_c.c against libfuse3 (``pkg-config fuse3``)."""
    out = work / "ramfs_c"
    src = BENCH / "ramfs_c.c"
    if out.exists() and out.stat().st_mtime_ns > src.stat().st_mtime_ns:
        return out
    flags = subprocess.run(["pkg-config", "--cflags", "--libs", "fuse3"], capture_output=True,
                           text=True, check=True).stdout.split()
    subprocess.run(["gcc", "-O2", "-Wall", "-o", str(out), str(src), *flags], check=True)
    return out


__all__ = ["Target", "SourceCold", "SourceWarm", "Kspeedfs", "KspeedfsStore", "RamFS", "UringKspeedfs",
           "build_ramfs_c", "package_cwd", "read_tree", "unmount"]
