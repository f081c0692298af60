"""① The native engine's side in Python: what the C request threads hand over.

    kernel ─ /dev/fuse ─► C threads (native/fuse_threads.c), one per core
        LOOKUP GETATTR READDIR(PLUS) OPEN RELEASE STATFS READLINK EROFS …   answered in C
        READ whose bytes the memory tier holds                            answered in C
        READ miss, GETXATTR, LISTXATTR, prefetch hints ─► queue + eventfd ─► NativeSession
    NativeSession (trio thread): Reader.read → reply on the fd the request came from

With ``fuse.io_uring = auto`` and a kernel that allows it (``enable_uring`` = Y), INIT
negotiates FUSE over io_uring and the C engine also serves one io_uring queue per CPU
(native/fuse_uring.c): requests then arrive on the queue of the reader's CPU,
and a queued request's "fd" is a ring token (negative) that the same ``_engine.reply*``
calls route back to its ring entry. Such a mount cannot be handed over or resumed
(``RING_LIFECYCLE``): it is not supervised, and ``--upgrade`` is refused.

The memory tier is shared through ``TierMirror``: every verified buffer that
``MemoryCache`` holds is also in the engine's table (the engine reads it in place and
keeps a reference count per reply; the buffer is released only when no reply points into
it), so a miss answered here is a hit in C the next time.

What stays the same as with pyfuse3 (``operations.py``): the manifest answers metadata,
``Reader`` answers data with all its guarantees, errors become errnos in
``boundary.fuse_op`` only, xattrs are ``Operations.xattr_values``. What differs: negative
lookups are cached by the kernel (the snapshot never changes), directories are opened
with ``FOPEN_CACHE_DIR``, READs are up to ``fuse.max_pages`` pages (1 MiB) and the INIT
flags are chosen here (fuse_engine.c ``fe_init``), and the connection is mounted with
mount(2) directly, so the engine needs root (``daemon.serve`` falls back to pyfuse3).
"""
from __future__ import annotations

import errno
import logging
import os
import resource
from typing import TYPE_CHECKING, Any

import pyfuse3
import trio

from ..cache.memory import PAGE, MemoryCache
from ..cache.prefetch import Stream
from ..config import FuseConfig
from ..errors import MountError
from ..manifest.index import ManifestIndex
from ..manifest.store.base import DatasetInfo
from .boundary import OpStats, fuse_op
from .operations import XATTR_PREFIX, Operations
from .upgrade import MAX_FDS, HandoverServer

if TYPE_CHECKING:
    from ..cluster.native_fetch import NativeFetch
    from .registry import LocalMount

log = logging.getLogger(__name__)


def _raise_fd_limit() -> None:
    """The soft limit on open files up to the hard one (at most 2^16): each request thread
    holds a /dev/fuse fd and, with fuse.splice, a pipe (two), so 253 threads take ~760
    of systemd's default soft limit of 1,024 that source reads and sockets also need.
    Nothing here uses select(2), the reason that soft limit stays low by default."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, 1 << 16) if hard != resource.RLIM_INFINITY else 1 << 16
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))

try:
    from . import _engine  # type: ignore[attr-defined]  # the C extension: no stubs
except ImportError as e:            # a checkout whose native code was not built
    _engine = None
    _IMPORT_ERROR = str(e)
else:
    _IMPORT_ERROR = ""

#: st_blksize when ``fuse.blksize`` is 0 (config.py says why: sweep-blksize)
SMALL_BLKSIZE = 4096

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


class NativeSession:
    """One native-engine mount: mounts ``path``, runs the C threads, answers their queue.

    ``mount()`` (blocking: mount(2), INIT, threads) then ``await serve()`` until the
    connection ends (unmounted, or ``terminate()``); ``close()`` joins the threads and
    releases every tier buffer. Misses run ``ops.reader.read_parts`` in this session's nursery
    and are answered on the fd their request came from; their errors go through
    ``boundary.fuse_op`` like every pyfuse3 handler's.

    Attributes:
        path: the mountpoint.
        ops: the pyfuse3 handlers' object, for its reader, xattrs and config.
        memory: the memory tier mirrored into the engine.
        engine: the C engine (``kspeedfs.fuse._engine.Engine``), after ``mount()``.
        slow_op, op_stats: what ``fuse_op`` needs (Python-side reads and xattrs).
        record: this mount in the registry of local mounts, published by its control
            socket's server (``fuse/upgrade.py``, ``fuse/registry.py``).
    """

    def __init__(self, path: str, ops: Operations, memory: MemoryCache, index: ManifestIndex,
                 info: DatasetInfo, cfg: FuseConfig, *, nonempty: bool = False,
                 record: LocalMount | None = None) -> None:
        self.path = path
        self.ops = ops
        self.memory = memory
        self.index = index
        self.info = info
        self.cfg = cfg
        self.nonempty = nonempty
        self.record = record
        self.slow_op = ops.slow_op
        self.op_stats = OpStats()
        ops.op_rows = self.op_rows           # the stats xattr counts what C answered too
        self.engine: Any = None
        self.fd = -1
        self.minor: int | None = None
        self._final: dict[str, Any] = {}
        self.handover: HandoverServer | None = None
        self.predecessor = 0
        self.resumed = False
        self.transport = "/dev/fuse"        # or "io_uring", once the threads run
        #: the chunk fetch in C (cluster/native_fetch.py), when the mount reads from peers
        self.fetch: NativeFetch | None = None

    # -- lifecycle ---------------------------------------------------------------------

    def mount(self) -> None:
        """mount(2), INIT and the request threads (blocking; OSError on failure, with
        nothing left mounted)."""
        assert _engine is not None
        fd = _engine.mount(self.path, f"kspeedfs:{self.info.name}", self.cfg.allow_other,
                           self.nonempty, self.cfg.max_pages * 4096)
        try:
            self.engine = self._engine(fd)
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
        session's from the call on (closed here on failure)."""
        try:
            minor, flags = int(state["minor"]), int(state["flags"])
            if flags & FUSE_OVER_IO_URING:
                raise ValueError(f"the connection runs io_uring queues ({RING_LIFECYCLE})")
            pages, readahead = int(state["max_pages"]), int(state["max_readahead"])
            connection = int(state["connection"])
            self.engine = self._engine(fds[0])
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

    def _engine(self, fd: int) -> Any:
        cfg = self.cfg
        return _engine.Engine(
            fd, self.index, generation=self.info.version, dataset_bytes=self.info.bytes,
            entry_timeout=cfg.entry_timeout, attr_timeout=cfg.attr_timeout,
            blksize=cfg.blksize or SMALL_BLKSIZE, xattrs=cfg.xattrs, max_background=cfg.max_background,
            congestion_threshold=cfg.congestion_threshold, max_pages=cfg.max_pages,
            prefetch_depth=cfg.prefetch_chunks, prefetch_trigger=2,
            uring=cfg.io_uring == "auto", splice=cfg.splice)

    def _start(self, fresh: bool = False) -> None:
        threads = min(self.cfg.threads or os.cpu_count() or 1, MAX_FDS)
        _raise_fd_limit()
        self.engine.start(threads)
        self.memory.mirror_to(TierMirror(self.engine))
        minor, flags, pages, readahead = self.engine.negotiated()
        self.transport, why = self.engine.transport()
        self.ops.transport_stats = self.transport_stats
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

    async def _hand_over(self) -> None:
        """A successor serves the connection now: end this daemon's C threads."""
        await trio.to_thread.run_sync(self.engine.stop)

    @property
    def handed_over(self) -> bool:
        return self.handover is not None and self.handover.handed_over.is_set()

    def terminate(self) -> None:
        """Unmount (lazily) and abort the connection: the C threads end, then ``serve``
        (not after a handover: the connection is the successor's)."""
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
        """After ``serve``: join the threads, stop mirroring, release every buffer."""
        if self.engine is None:
            return
        self.memory.mirror_to(None)
        self.engine.join()
        self._final = self.engine.counters()
        self.engine.close()
        self.engine = None

    # -- the queue ---------------------------------------------------------------------

    async def serve(self) -> None:
        """Answer queued requests until the connection ends, or until a successor took
        it over (then the requests already queued here are answered first)."""
        efd = self.engine.eventfd
        async with trio.open_nursery() as nursery:
            self.handover = HandoverServer(self.path, self.info.name, self.info.version,
                                           self.fd, self.state, self._hand_over,
                                           stats=self.ops.stats_record, record=self.record)
            await nursery.start(self.handover.run)
            if self.resumed:
                nursery.start_soon(self._report_resent)
            while True:
                await trio.lowlevel.wait_readable(efd)
                try:
                    os.read(efd, 8)
                except BlockingIOError:
                    pass
                while batch := self.engine.take(1024):
                    for req in batch:
                        self._dispatch(nursery, req)
                self.engine.reap()
                if not self.engine.running:
                    break
            if self.handed_over:                # what the last threads queued, then done
                if self.fetch is not None:      # its parked READs answered, or queued
                    await self.fetch.aclose()
                while batch := self.engine.take(1024):
                    for req in batch:
                        self._dispatch(nursery, req)
            else:
                nursery.cancel_scope.cancel()  # the connection is gone: nobody to answer

    def _dispatch(self, nursery: trio.Nursery, ev: Any) -> None:
        kind = type(ev)                         # one of take()'s named types
        if kind is _engine.Read:
            # a small file or a block from a peer: C READs and answers it, and the READ
            # needs no task of its own (random 4 KiB from peers, 4 jobs: the trio thread
            # 62-63 against 77-85 µs a READ, 8,729-8,828 against 7,021-8,239 IOPS)
            if self.fetch is None or not self.ops.reader.hand_off(
                    ev.entry, (ev.fd, ev.unique, ev.offset, ev.size, ev.random, ev.since)):
                nursery.start_soon(self._answer_read, ev.fd, ev.unique, ev.entry, ev.offset,
                                   ev.size, ev.random, ev.since)
        elif kind is _engine.Prefetch:
            self.ops.reader.reached(ev.reached)
            for k in range(ev.first, ev.stop):
                self.ops.reader.prefetch(ev.entry, k)
        elif kind is _engine.Fetched:
            if self.fetch is not None:
                self.fetch.fetched(ev.cookie, ev.chunk, ev.status, ev.slot, ev.peer, ev.path,
                                   ev.since)
        elif kind is _engine.Getxattr:
            nursery.start_soon(self._answer_getxattr, ev.fd, ev.unique, ev.entry, ev.name,
                               ev.size, ev.since)
        elif kind is _engine.Listxattr:
            nursery.start_soon(self._answer_listxattr, ev.fd, ev.unique, ev.entry, ev.size,
                               ev.since)

    # the handlers' since= is @fuse_op's (boundary.py), not in their signatures: hence the
    # call-arg ignores below

    async def _answer_read(self, fd: int, unique: int, entry: int, offset: int, size: int,
                           random: int, since: float) -> None:
        # the C thread did the sequential-read bookkeeping; this stream only carries
        # its verdict (``read_policy.is_random``) and starts no prefetch of its own
        stream = Stream(next_offset=-1 if random else offset)
        try:
            data = await self.read(entry, offset, size, stream, since=since)  # type: ignore[call-arg]
        except pyfuse3.FUSEError as e:
            _engine.reply_error(fd, unique, e.errno)
            return
        _engine.reply(fd, unique, data)

    async def _answer_getxattr(self, fd: int, unique: int, entry: int, name: bytes,
                               size: int, since: float) -> None:
        try:
            value = await self.getxattr(entry, name, since=since)  # type: ignore[call-arg]
        except pyfuse3.FUSEError as e:
            _engine.reply_error(fd, unique, e.errno)
            return
        self._reply_xattr(fd, unique, value, size)

    async def _answer_listxattr(self, fd: int, unique: int, entry: int, size: int,
                                since: float) -> None:
        try:
            names = await self.listxattr(entry, since=since)  # type: ignore[call-arg]
        except pyfuse3.FUSEError as e:
            _engine.reply_error(fd, unique, e.errno)
            return
        self._reply_xattr(fd, unique, b"".join(n + b"\0" for n in names), size)

    async def _report_resent(self) -> None:
        await trio.sleep(2.0)          # the re-queued requests come first, at once
        if self.engine is not None:
            log.info("resume: answered %d requests the dead daemon had left unanswered",
                     self.engine.counters().get("resent", 0))

    @staticmethod
    def _reply_xattr(fd: int, unique: int, value: bytes, size: int) -> None:
        if size == 0:
            _engine.reply_xattr_size(fd, unique, len(value))
        elif len(value) > size:
            _engine.reply_error(fd, unique, errno.ERANGE)
        else:
            _engine.reply(fd, unique, value)

    # -- the handlers (through the one errno boundary) -----------------------------------

    @fuse_op
    async def read(self, entry: int, offset: int, size: int, stream: Stream) -> Any:
        return await self.ops.reader.read_parts(entry, offset, size, stream)

    @fuse_op
    async def getxattr(self, entry: int, name: bytes) -> bytes:
        if not name.startswith(XATTR_PREFIX):
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        value = self.ops.xattr_values(entry).get(name[len(XATTR_PREFIX):])
        if value is None:
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        return value

    @fuse_op
    async def listxattr(self, entry: int) -> list[bytes]:
        return [XATTR_PREFIX + k for k in self.ops.xattr_values(entry)]

    # -- counters ----------------------------------------------------------------------

    def counters(self) -> dict[str, Any]:
        """The C threads' counters (``Engine.counters()``; their last values once closed)."""
        return self.engine.counters() if self.engine is not None else self._final

    def transport_stats(self) -> dict[str, Any]:
        """How requests reach this daemon, and the io_uring queues' counters: requests
        through them, and the bytes and time of copying READ hits into their payload
        buffers (what /dev/fuse's writev from the tier does not cost); READ replies sent
        by splice (``spliced``, ``spliced_bytes``: fuse.splice); READs the tier
        could not answer in C (``read_misses``: ``fetch_parked`` of them waited for the
        native fetch, ``late_hits`` were answered from the tier in C once their chunks had
        landed, the rest were answered in Python) and prefetch hints sent to
        Python; the solo gate's (``gate_waits``, ``shared_requests``, the times it
        opened for another task or a request that was not readahead, and the windows
        the crowd rule began to keep it as it was: fuse_threads.c); and
        the native chunk fetch's counters (native/fuse_fetch.h; ``fetch_started``: of
        ``fetch_posted``, the chunks and extents C started from Python's routes,
        ``fetch_started_parts``: of those, small files' extents)."""
        c = self.counters()
        return {"transport": f"native {self.transport}",
                **{k: c.get(k, 0) for k in ("spliced", "spliced_bytes",
                                            "ring_requests", "ring_copy_bytes", "ring_copy_ns",
                                            "ring_lost", "read_misses", "late_hits", "prefetch_hints",
                                            "gate_waits", "shared_requests",
                                            "gate_opened_tasks", "gate_opened_requests",
                                            "gate_crowded",
                                            "fetch_posted", "fetch_landed", "fetch_failed",
                                            "fetch_redundant", "fetch_parked",
                                            "fetch_answered", "fetch_started",
                                            "fetch_started_parts")}}

    def served(self) -> tuple[int, int, int]:
        """Reads, bytes and memory-tier units answered in C (``Reader.served_elsewhere``)."""
        c = self.counters()
        return c.get("read_hits", 0), c.get("read_hit_bytes", 0), c.get("memory_hits", 0)

    def notify_store(self, inode: int, offset: int, data: Any) -> None:
        """``pyfuse3.notify_store`` for this connection (``fuse/pagecache.py``)."""
        rc = _engine.notify_store(self.fd, inode, offset, data)
        if rc < 0:
            raise OSError(-rc, os.strerror(-rc))

    def op_rows(self) -> dict[str, list[Any]]:
        """Per-operation rows in ``OpStats`` form: C's (hits and metadata) plus Python's
        (read misses and xattrs), summed."""
        rows = {name: list(row) for name, row in self.op_stats.rows.items() if row[0]}
        for name, (n, errs, secs, buckets) in self.counters().get("ops", {}).items():
            if not n:
                continue
            row = rows.setdefault(name, [0, 0, 0.0] + [0] * (len(OpStats.BOUNDS) + 1))
            row[0] += n
            row[1] += errs
            row[2] += secs
            for i, b in enumerate(buckets):
                row[3 + i] += b
        return rows
