"""① The native engine's side in Python: what the C request threads hand over.

    kernel ─ /dev/fuse ─► C threads (native/fuse_threads.c), one per core
        LOOKUP GETATTR READDIR(PLUS) OPEN RELEASE STATFS READLINK EROFS …   answered in C
        READ whose bytes the memory tier holds                            answered in C
        READ miss, GETXATTR, LISTXATTR, prefetch hints ─► queue + eventfd ─► NativeSession
    NativeSession (trio thread): Reader.read → reply on the fd the request came from

What is where:
    native.py      NativeSession: the mount as ``daemon.py`` drives it (a façade over
                   the three below), and its counters as the stats xattr and metrics
                   read them
    connection.py  NativeConnection: the C extension, mount(2) + INIT or a connection
                   handed over, the threads, the handover socket, unmount, close; the
                   memory tier mirrored into C (``TierMirror``)
    events.py      EventPump: the engine's queue taken and dispatched by kind
    replies.py     Replies: READ misses and xattrs answered in Python

What stays the same as with pyfuse3 (``operations.py``): the manifest answers metadata,
``Reader`` answers data with all its guarantees, errors become errnos in
``boundary.fuse_op`` only, xattrs are ``Operations.xattr_values``. What differs: negative
lookups are cached by the kernel (the snapshot never changes), directories are opened
with ``FOPEN_CACHE_DIR``, READs are up to ``fuse.max_pages`` pages (1 MiB) and the INIT
flags are chosen in C (fuse_engine.c ``fe_init``), and the connection is mounted with
mount(2) directly, so the engine needs root (``daemon.serve`` falls back to pyfuse3).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import trio

from ..cache.memory import MemoryCache
from ..config import FuseConfig
from ..manifest.index import ManifestIndex
from ..manifest.store.base import DatasetInfo
from .boundary import OpStats
from .connection import RING_LIFECYCLE as RING_LIFECYCLE
from .connection import NativeConnection
from .connection import TierMirror as TierMirror
from .connection import unavailable as unavailable
from .events import EventPump
from .operations import Operations
from .replies import Replies

if TYPE_CHECKING:
    from ..cluster.native.fetch import NativeFetch
    from .registry import LocalMount


class NativeSession:
    """One native-engine mount: mounts ``path``, runs the C threads, answers their queue.

    ``mount()`` (blocking: mount(2), INIT, threads) then ``await serve()`` until the
    connection ends (unmounted, or ``terminate()``); ``close()`` joins the threads and
    releases every tier buffer. Misses run ``ops.reader.read_parts`` in this session's nursery
    and are answered on the fd their request came from; their errors go through
    ``boundary.fuse_op`` like every pyfuse3 handler's. The work is the parts': the
    connection's life (``connection``), the queue's pump (``pump``) and Python's answers
    (``replies``); this object composes them and sums their counters.

    Attributes:
        path: the mountpoint.
        ops: the pyfuse3 handlers' object, for its reader, xattrs and config.
        memory: the memory tier mirrored into the engine.
        engine: the C engine (``kspeedfs.fuse._engine.Engine``), after ``mount()``.
        transport: "/dev/fuse" or "io_uring", once the threads run.
        fetch: the chunk fetch in C (cluster/native/fetch.py), when the mount reads from
            peers (set by the daemon, possibly while ``serve`` runs).
        slow_op, op_stats: ``Replies``': the threshold ``fuse_op`` logs by, and the rows of
            what Python answered (read misses and xattrs).
        read, getxattr, listxattr: ``Replies``' handlers.
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
        self.connection = NativeConnection(path, memory, index, info, cfg, nonempty=nonempty)
        self.replies = Replies(ops)
        self.pump = EventPump(ops.reader, self.replies)
        self.slow_op = self.replies.slow_op
        self.op_stats = self.replies.op_stats
        self.read = self.replies.read
        self.getxattr = self.replies.getxattr
        self.listxattr = self.replies.listxattr
        ops.op_rows = self.op_rows           # the stats xattr counts what C answered too
        ops.transport_stats = self.transport_stats

    @property
    def engine(self) -> Any:
        return self.connection.engine

    @property
    def transport(self) -> str:
        return self.connection.transport

    @property
    def fetch(self) -> NativeFetch | None:
        return self.pump.fetch

    @fetch.setter
    def fetch(self, fetch: NativeFetch | None) -> None:
        self.pump.fetch = fetch

    # -- lifecycle (the connection's) --------------------------------------------------

    def mount(self) -> None:
        """mount(2), INIT and the request threads (blocking; OSError on failure, with
        nothing left mounted)."""
        self.connection.mount()

    def adopt(self, fds: list[int], state: dict[str, Any], resume: bool) -> None:
        """Serve a live connection handed over (``NativeConnection.adopt``; blocking)."""
        self.connection.adopt(fds, state, resume)

    async def predecessor_gone(self, timeout: float = 15.0) -> None:
        """After an upgrade: wait (bounded) until the old daemon has exited."""
        await self.connection.predecessor_gone(timeout)

    def state(self) -> dict[str, Any]:
        """What a successor needs to serve this connection (``upgrade.py``, format 1)."""
        return self.connection.state()

    @property
    def handed_over(self) -> bool:
        return self.connection.handed_over

    def terminate(self) -> None:
        """Unmount (lazily) and abort the connection: the C threads end, then ``serve``
        (not after a handover: the connection is the successor's)."""
        self.connection.terminate()

    def close(self) -> None:
        """After ``serve``: join the threads, stop mirroring, release every buffer."""
        self.connection.close()

    # -- the queue ---------------------------------------------------------------------

    async def serve(self) -> None:
        """Answer queued requests until the connection ends, or until a successor took
        it over (then the requests already queued here are answered first)."""
        engine = self.connection.engine
        async with trio.open_nursery() as nursery:
            await self.connection.offer(nursery, self.ops.stats_record, self.record)
            if self.connection.resumed:
                nursery.start_soon(self.connection.report_resent)
            await self.pump.run(engine, nursery)
            if self.handed_over:                # what the last threads queued, then done
                await self.pump.drain(engine, nursery)
            else:
                nursery.cancel_scope.cancel()  # the connection is gone: nobody to answer

    # -- counters ----------------------------------------------------------------------

    def counters(self) -> dict[str, Any]:
        """The C threads' counters (``Engine.counters()``; their last values once closed)."""
        return self.connection.counters()

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
        ``fetch_started_parts``: of those, small files' extents; ``fetch_unkept``: of
        ``fetch_landed``, extents answered from their staging slot and not kept;
        ``fetch_tallied``: of ``fetch_landed``, extents and blocks C started and told
        Python in a tally, not by a FETCHED each)."""
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
                                            "fetch_started_parts", "fetch_unkept",
                                            "fetch_tallied")}}

    def served(self) -> tuple[int, int, int]:
        """Reads, bytes and memory-tier units answered in C (``Reader.served_elsewhere``)."""
        c = self.counters()
        return c.get("read_hits", 0), c.get("read_hit_bytes", 0), c.get("memory_hits", 0)

    def notify_store(self, inode: int, offset: int, data: Any) -> None:
        """``pyfuse3.notify_store`` for this connection (``fuse/pagecache.py``)."""
        self.connection.notify_store(inode, offset, data)

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
