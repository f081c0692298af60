"""The native engine's FUSE connection: the C extension, and one connection's life.

    _engine            the C extension (``kspeedfs.fuse._engine``), or None when not built
    unavailable()      why the native engine cannot serve a mount here
    TierMirror         the engine's table of ``MemoryCache``'s buffers
    NativeConnection   mount(2) + INIT, or a connection handed over (upgrade, resume);
                       the C threads; the control socket a successor takes it over by;
                       unmount + abort; joined threads and released buffers at close

With ``fuse.io_uring = auto`` and a kernel that allows it (``enable_uring`` = Y), INIT
negotiates FUSE over io_uring and the C engine also serves one io_uring queue per CPU
(native/fuse_uring.c): requests then arrive on the queue of the reader's CPU,
and a queued request's "fd" is a ring token (negative) that the same ``_engine.reply*``
calls route back to its ring entry. Such a mount cannot be handed over or resumed
(``RING_LIFECYCLE``): it is not supervised, and ``--upgrade`` is refused.

The memory tier is shared through ``TierMirror``: every verified buffer that
``MemoryCache`` holds is also in the engine's table (the engine reads it in place and
keeps a reference count per reply; the buffer is released only when no reply points into
it), so a miss answered in Python is a hit in C the next time.

The connection is mounted with mount(2) directly, so the engine needs root
(``daemon.serve`` falls back to pyfuse3); the INIT flags are chosen in C (fuse_engine.c
``fe_init``).
"""
from __future__ import annotations

import logging
import os
import resource
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio

from ..cache.memory import PAGE, MemoryCache
from ..config import FuseConfig
from ..errors import MountError
from ..manifest.index import ManifestIndex
from ..manifest.store.base import DatasetInfo
from ..tuning import SMALL_BLKSIZE
from .upgrade import MAX_FDS, HandoverServer

if TYPE_CHECKING:
    from .registry import LocalMount

log = logging.getLogger(__name__)

try:
    from . import _engine as _engine  # type: ignore[attr-defined]  # the C extension: no stubs
except ImportError as e:            # a checkout whose native code was not built
    _engine = None
    _IMPORT_ERROR = str(e)
else:
    _IMPORT_ERROR = ""


#: FUSE_OVER_IO_URING in the negotiated INIT flags (flags2 bit 9)
FUSE_OVER_IO_URING = 1 << 41

#: Why an io_uring mount is neither upgraded nor resumed (docs/design.md, kernel 6.18
#: fs/fuse/dev_uring.c): a ring entry is a pair of buffers in the registering process's
#: memory, served by that process's io_uring; another process cannot commit it. When the
#: rings close (exit, crash) the kernel cancels only the entries waiting for a request;
#: a request already sent to an entry stays there, unanswered, until the connection is
#: aborted, and FUSE_NOTIFY_RESEND re-queues /dev/fuse's requests, not the rings'. A
#: supervisor keeping the connection alive would keep those readers hanging forever.
RING_LIFECYCLE = ("the kernel ties io_uring ring entries to the process that registered "
                  "them: requests held by a dead or departing daemon's entries are never "
                  "answered nor re-sent (FUSE_NOTIFY_RESEND covers /dev/fuse only)")


def unavailable() -> str:
    """Why the native engine cannot serve a mount here ("" if it can)."""
    if _engine is None:
        return f"not built ({_IMPORT_ERROR})"
    if os.geteuid() != 0:
        return "needs root (it mounts with mount(2))"
    return ""


def _raise_fd_limit() -> None:
    """The soft limit on open files up to the hard one (at most 2^16): each request thread
    holds a /dev/fuse fd and, with fuse.splice, a pipe (two), so 253 threads take ~760
    of systemd's default soft limit of 1,024 that source reads and sockets also need.
    Nothing here uses select(2), the reason that soft limit stays low by default."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, 1 << 16) if hard != resource.RLIM_INFINITY else 1 << 16
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


class TierMirror:
    """The engine's view of ``MemoryCache``: ``put``/``discard`` keep the engine's table
    equal to the cache's contents; ``touched`` tells the cache's LRU that a C thread
    served a buffer since it last asked (a second chance before eviction), ``served``
    that one ever did since its put (a prefetched chunk its reader has reached)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def put(self, key: bytes, data: Any) -> None:
        self.engine.tier_put(key, data)

    def discard(self, key: bytes) -> None:
        self.engine.tier_discard(key)
        self.engine.reap()

    def touched(self, key: bytes) -> bool:
        return bool(self.engine.tier_touched(key))

    def served(self, key: bytes) -> bool:
        return bool(self.engine.tier_touched(key, served=True))


class NativeConnection:
    """One FUSE connection the C engine serves, from mount (or takeover) to close.

    ``mount()`` or ``adopt()`` (blocking) leave the C threads running and ``engine`` set;
    ``await offer(nursery, ...)`` listens for a successor (``fuse/upgrade.py``); the
    threads end when the connection does (``terminate()``, an unmount) or a successor
    took it over (``handed_over``); ``close()`` then joins them and releases every tier
    buffer. Owns the engine, its fds and the memory tier's mirror into it; the blocking
    calls run in a worker thread, the rest on the trio thread.

    Attributes:
        engine: the C engine (``kspeedfs.fuse._engine.Engine``) while it runs, else None.
        fd: the connection's /dev/fuse fd (the master).
        minor: the connection's number under /sys/fs/fuse/connections.
        transport: "/dev/fuse" or "io_uring", once the threads run.
        resumed: the kernel re-sent what a crashed predecessor left unanswered.
        handover: the control socket's server, from ``offer`` on.
    """

    def __init__(self, path: str, memory: MemoryCache, index: ManifestIndex, info: DatasetInfo,
                 cfg: FuseConfig, *, nonempty: bool = False) -> None:
        self.path = path
        self.memory = memory
        self.index = index
        self.info = info
        self.cfg = cfg
        self.nonempty = nonempty
        self.engine: Any = None
        self.fd = -1
        self.minor: int | None = None
        self.final: dict[str, Any] = {}     # the counters at close
        self.handover: HandoverServer | None = None
        self.predecessor = 0
        self.resumed = False
        self.transport = "/dev/fuse"

    def mount(self) -> None:
        """mount(2), INIT and the request threads (blocking; OSError on failure, with
        nothing left mounted)."""
        assert _engine is not None
        fd = _engine.mount(self.path, f"kspeedfs:{self.info.name}", self.cfg.allow_other,
                           self.nonempty, self.cfg.max_pages * 4096)
        try:
            self.engine = self._new_engine(fd)
        except BaseException:
            os.close(fd)
            _engine.unmount(self.path)
            raise
        self.fd = fd
        try:
            self.engine.init()
            self._start(fresh=True)
        except BaseException:
            _engine.unmount(self.path)
            self.engine.close()
            self.engine = None
            raise
        self.minor = os.minor(os.stat(self.path).st_dev)    # answered by the C threads

    def adopt(self, fds: list[int], state: dict[str, Any], resume: bool) -> None:
        """Serve a live connection handed over (``fuse/upgrade.py``): its INIT results
        instead of a new INIT (blocking). An upgrade hands the master fd; a resume (the
        supervisor, after a crash) every fd the dead daemon read, which the threads read
        again, then FUSE_NOTIFY_RESEND queues what it left unanswered. The fds are this
        connection's from the call on (closed here on failure)."""
        try:
            minor, flags = int(state["minor"]), int(state["flags"])
            if flags & FUSE_OVER_IO_URING:
                raise ValueError(f"the connection runs io_uring queues ({RING_LIFECYCLE})")
            pages, readahead = int(state["max_pages"]), int(state["max_readahead"])
            connection = int(state["connection"])
            self.engine = self._new_engine(fds[0])
        except (KeyError, TypeError, ValueError) as e:
            for fd in fds:
                os.close(fd)
            raise MountError(f"upgrade: handover state unusable: {e!r}") from None
        self.fd = fds[0]
        try:
            self.engine.adopt(minor, flags, pages, readahead)
            if resume:
                self.engine.give_fds(fds)
            self._start()
        except BaseException:
            self.engine.close()                 # closes fds[0]
            for fd in fds[1:]:
                os.close(fd)
            self.engine = None
            raise
        self.minor = connection
        self.predecessor = 0 if resume else int(state.get("pid") or 0)
        if resume:
            self._resend()

    def _resend(self) -> None:
        rc = _engine.notify_resend(self.fd)
        if rc < 0:
            log.error("resume: FUSE_NOTIFY_RESEND failed (%s): the requests the dead daemon "
                      "had read stay unanswered (kernel before 6.9?)", os.strerror(-rc))
        else:
            log.info("resume: the kernel queued again what the dead daemon left unanswered")
            self.resumed = True

    async def predecessor_gone(self, timeout: float = 15.0) -> None:
        """After an upgrade: wait (bounded) until the old daemon has exited."""
        with trio.move_on_after(timeout):
            while self.predecessor and os.path.exists(f"/proc/{self.predecessor}"):
                await trio.sleep(0.05)

    def _new_engine(self, fd: int) -> Any:
        cfg = self.cfg
        return _engine.Engine(
            fd, self.index, generation=self.info.version, dataset_bytes=self.info.bytes,
            entry_timeout=cfg.entry_timeout, attr_timeout=cfg.attr_timeout,
            blksize=cfg.blksize or SMALL_BLKSIZE, xattrs=cfg.xattrs, max_background=cfg.max_background,
            congestion_threshold=cfg.congestion_threshold, max_pages=cfg.max_pages,
            prefetch_depth=cfg.prefetch_chunks, prefetch_trigger=2,
            uring=cfg.io_uring == "auto", splice=cfg.splice,
            pages=self.index.pages.native if self.index.pages is not None else None)

    def _start(self, fresh: bool = False) -> None:
        threads = min(self.cfg.threads or os.cpu_count() or 1, MAX_FDS)
        _raise_fd_limit()
        self.engine.start(threads)
        self.memory.mirror_to(TierMirror(self.engine))
        minor, flags, pages, readahead = self.engine.negotiated()
        self.transport, why = self.engine.transport()
        log.info("native engine: %d threads over %s, FUSE 7.%d, flags %#x, %d pages per "
                 "request, readahead %d KiB", threads, self.transport, minor, flags, pages,
                 readahead >> 10)
        if self.transport == "/dev/fuse" and self.cfg.splice:
            room = _engine.splice_room()
            if room < pages * PAGE:
                log.info("READ replies by splice up to %d KiB; larger ones by writev (a pipe "
                         "of this process holds %d KiB: fs.pipe-max-size)", room >> 10,
                         (room + PAGE) >> 10)
        if why:
            log.warning("io_uring negotiated but not in use (%s): /dev/fuse serves", why)
        elif fresh and self.cfg.io_uring == "auto" and not flags & FUSE_OVER_IO_URING:
            log.info("io_uring: not offered by the kernel (/sys/module/fuse/parameters/"
                     "enable_uring is not Y, or a kernel before 6.14): /dev/fuse serves")

    def state(self) -> dict[str, Any]:
        """What a successor needs to serve this connection (``upgrade.py``, format 1)."""
        minor, flags, pages, readahead = self.engine.negotiated()
        return {"dataset": self.info.name, "version": self.info.version, "minor": minor,
                "flags": flags, "max_pages": pages, "max_readahead": readahead,
                "connection": self.minor, "pid": os.getpid(), "transport": self.transport}

    async def offer(self, nursery: trio.Nursery, stats: Callable[[], dict[str, Any]],
                    record: LocalMount | None) -> None:
        """Listen for a successor on the mount's control socket, in ``nursery``
        (``stats``: what a ``stats`` request gets; ``record``: this mount's entry in the
        registry of local mounts, ``fuse/registry.py``)."""
        self.handover = HandoverServer(self.path, self.info.name, self.info.version, self.fd,
                                       self.state, self._hand_over, stats=stats, record=record)
        await nursery.start(self.handover.run)

    async def _hand_over(self) -> None:
        """A successor serves the connection now: end this daemon's C threads."""
        await trio.to_thread.run_sync(self.engine.stop)

    @property
    def handed_over(self) -> bool:
        return self.handover is not None and self.handover.handed_over.is_set()

    async def report_resent(self) -> None:
        """After a resume: log how many re-sent requests were answered."""
        await trio.sleep(2.0)          # the re-queued requests come first, at once
        if self.engine is not None:
            log.info("resume: answered %d requests the dead daemon had left unanswered",
                     self.engine.counters().get("resent", 0))

    def terminate(self) -> None:
        """Unmount (lazily) and abort the connection: the C threads end, then the queue's
        pump (not after a handover: the connection is the successor's)."""
        if self.engine is None or self.handed_over:
            return
        try:
            _engine.unmount(self.path)
        except OSError as e:
            log.debug("unmount %s: %s", self.path, e)
        if self.minor is not None:
            try:
                with open(f"/sys/fs/fuse/connections/{self.minor}/abort", "w") as f:
                    f.write("1")
            except OSError as e:
                log.debug("abort connection %d: %s", self.minor, e)

    def close(self) -> None:
        """After the threads ended: join them, stop mirroring, release every buffer."""
        if self.engine is None:
            return
        self.memory.mirror_to(None)
        self.engine.join()
        self.final = self.engine.counters()
        self.engine.close()
        self.engine = None

    def counters(self) -> dict[str, Any]:
        """The C threads' counters (``Engine.counters()``; their last values once closed)."""
        return self.engine.counters() if self.engine is not None else self.final

    def notify_store(self, inode: int, offset: int, data: Any) -> None:
        """``pyfuse3.notify_store`` for this connection (``fuse/pagecache.py``)."""
        rc = _engine.notify_store(self.fd, inode, offset, data)
        if rc < 0:
            raise OSError(-rc, os.strerror(-rc))
