"""The trio thread a library ``Dataset`` reads through ("kspeedfs-<name>").

    ReadLoop(cfg, info, index, source)   starts the thread and waits until the read path
                                         is built, as a mount builds it (compose.py):
      compose.local_tiers                origin, memory tier, disk tier (worker thread)
      compose.cluster → peers?           vRDMA endpoint and membership, in a cluster
      compose.host_grant → host?         the node on this host's granted segments, mapped
      compose.new_reader                 the Reader, its loads in this thread's nursery
      PeerWait → peer_wait?              small files' extents READ from peers in C by
                                         the calling threads (cluster/peer_wait.py)
    call(afn, *args)                     ``await afn(*args)`` here, from a caller's thread
    acall(afn, *args)                    the same, awaited by a caller's asyncio or trio
                                         task: started here with no thread blocked, its
                                         outcome handed back to the caller's event loop
    close()                              stops the loop; the tiers and the cluster go

Why a thread of its own, and not ``trio.run`` per call: docs/design.md, "The Python
library".
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import logging
import os
import threading
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import outcome
import sniffio
import trio

from .. import compose
from ..cache.memory import MemoryCache
from ..config import Config
from ..manifest.index import ManifestIndex
from ..manifest.store.base import DatasetInfo
from ..reader import Reader
from ..stats import ReadStatistics
from ..tuning import SMALL_FILE_DIVISOR
from .errors import PathLike, boundary

if TYPE_CHECKING:
    from ..cluster.granted import HostGrant
    from ..cluster.peer_wait import PeerWait

__all__ = ["ReadLoop"]

T = TypeVar("T")
log = logging.getLogger(__name__)


class ReadLoop:
    """The Reader of one dataset version, hosted in a trio run in a thread of its own.

    The constructor returns once the read path is built, or raises what failed (through
    the caller's error boundary). ``call`` runs a coroutine in the loop from any thread
    of the opening process and returns its result, errors mapped by ``client/errors.py``;
    every call, and ``check``, raises ValueError once closed and RuntimeError in a forked
    child (the thread, and a cluster's channels and endpoint, are not there). Reads
    answered outside the loop are added with ``count`` so ``statistics()`` includes them
    (``Reader.served_elsewhere``), those copied from the host's grant as host hits;
    ``count`` is thread-safe.

    Attributes:
        info: the dataset's record.
        reader: the Reader (use it in the loop only: ``call``).
        memory: the memory tier (its resident part may be read from any thread).
        host: the granted segments of the node on this host, or None
            (``HostGrant.copy_nowait`` may be called from any thread).
        peer_wait: small files' extents READ from peers in C by the calling thread
            (``PeerWait.read``, any thread), or None: not a cluster, no soft provider,
            ``cluster.native_fetch`` off.
    """

    reader: Reader
    memory: MemoryCache
    host: HostGrant | None = None
    peer_wait: PeerWait | None = None
    _nursery: trio.Nursery

    def __init__(self, cfg: Config, info: DatasetInfo, index: ManifestIndex,
                 source: str | None = None) -> None:
        self.info = info
        self._cfg = cfg
        self._index = index
        self._source = source
        self._pid = os.getpid()
        # reads, bytes, memory hits, host hits, host bytes, peer hits, peer bytes answered
        # outside; under _lock
        self._served = [0, 0, 0, 0, 0, 0, 0]
        self._lock = threading.Lock()
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._started = threading.Event()
        self._failed: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"kspeedfs-{info.name}",
                                        daemon=True)
        self._thread.start()
        self._started.wait()
        if self._failed is not None:
            self._thread.join()
            raise self._failed

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as e:      # before started: the opener raises it
            if self._started.is_set():
                log.exception("dataset %s: its read loop failed", self.info.name)
            while isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:
                e = e.exceptions[0]     # a nursery's one error, as itself (the boundary maps it)
            self._failed = e
        finally:
            self._started.set()

    async def _main(self) -> None:
        """The read path's lifetime: built as a mount builds it, torn down on close."""
        cfg, info, index = self._cfg, self.info, self._index
        tiers = await trio.to_thread.run_sync(compose.local_tiers, cfg, info, index, self._source)
        async with compose.cluster(cfg, index) as (peers, _store), \
                compose.host_grant(cfg, info, index, peers) as host, \
                trio.open_nursery() as nursery:
            self.reader = compose.new_reader(cfg, info, index, tiers, nursery, peers, host=host)
            self.reader.served_elsewhere = self._served_outside
            self.memory = tiers.memory
            self.host = host
            self.peer_wait = _peer_wait(cfg, index, peers)
            if self.peer_wait is not None:
                nursery.start_soon(self.peer_wait.run)
            self._nursery = nursery
            self._token = trio.lowlevel.current_trio_token()
            self._stop = trio.Event()
            self._started.set()
            try:
                await self._stop.wait()
            finally:
                if self.peer_wait is not None:
                    with trio.CancelScope(shield=True):
                        await self.peer_wait.aclose()
            nursery.cancel_scope.cancel()

    def call(self, afn: Callable[..., Awaitable[T]], *args: Any,
             path: PathLike | None = None) -> T:
        """``await afn(*args)`` in the loop, from a caller's thread."""
        self.check()
        with boundary(path):
            try:
                return trio.from_thread.run(afn, *args, trio_token=self._token)
            except trio.RunFinishedError:
                raise ValueError("I/O operation on a closed dataset") from None

    async def acall(self, afn: Callable[..., Awaitable[T]], *args: Any,
                    path: PathLike | None = None) -> T:
        """``await afn(*args)`` in the loop, awaited from an asyncio or trio task of
        any thread: no thread waits for it. Cancelling the caller abandons the answer,
        not the read (it ends in the loop, as a thread's read would); errors are those
        of :meth:`call`."""
        self.check()
        library = sniffio.current_async_library()
        if library == "asyncio":
            loop = asyncio.get_running_loop()
            future: asyncio.Future[outcome.Outcome[Any]] = loop.create_future()
            self._submit(afn, args, lambda o: loop.call_soon_threadsafe(_settle, future, o))
            result = await future
        elif library == "trio":
            token, done, box = trio.lowlevel.current_trio_token(), trio.Event(), []

            def answered(o: outcome.Outcome[Any]) -> None:
                box.append(o)
                with contextlib.suppress(trio.RunFinishedError):   # the caller's run ended
                    token.run_sync_soon(done.set)
            self._submit(afn, args, answered)
            await done.wait()
            result = box[0]
        else:
            raise RuntimeError(f"kspeedfs reads are awaited from asyncio or trio, not {library}")
        with boundary(path):
            return result.unwrap()  # type: ignore[no-any-return]

    def _submit(self, afn: Callable[..., Awaitable[Any]], args: tuple[Any, ...],
                answer: Callable[[outcome.Outcome[Any]], object]) -> None:
        """Start ``afn(*args)`` as a task of the loop; ``answer`` gets its outcome, in
        the loop's thread (a close cancelling it: ValueError, as a closed handle's)."""
        async def task() -> None:
            o = await outcome.acapture(afn, *args)
            if isinstance(o, outcome.Error) and isinstance(o.error, trio.Cancelled):
                o = outcome.Error(ValueError("I/O operation on a closed dataset"))
            answer(o)

        assert self._token is not None
        try:
            self._token.run_sync_soon(self._nursery.start_soon, task)
        except trio.RunFinishedError:
            raise ValueError("I/O operation on a closed dataset") from None

    def check(self) -> None:
        """Raise unless this handle may be used here: ValueError once closed,
        RuntimeError in a process other than the one that opened it."""
        if self._closed:
            raise ValueError("I/O operation on a closed dataset")
        if self._index.pages is not None and self._index.pages.failure:
            raise OSError(errno.EIO, f"the manifest of {self.info.name} v{self.info.version} "
                          f"is unreadable: {self._index.pages.failure}")
        if os.getpid() != self._pid:
            raise RuntimeError(f"dataset {self.info.name} was opened in process {self._pid}; "
                               "open one in each process after it forks (kspeedfs.torch)")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Stop the loop and drop the tiers; idempotent."""
        if self._closed:
            return
        self._closed = True
        if os.getpid() != self._pid:      # a forked child's copy: nothing of it runs here
            return
        if self._stop is not None and self._thread.is_alive():
            with contextlib.suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join()

    def count(self, nbytes: int, hits: int, host_bytes: int = 0, peer_bytes: int = 0) -> None:
        """One read of ``nbytes`` answered outside the loop from ``hits`` memory-tier
        buffers, or from one copy of ``host_bytes`` out of the host's grant, or from one
        READ of ``peer_bytes`` from a peer in C (any thread)."""
        with self._lock:
            self._served[0] += 1
            self._served[1] += nbytes
            self._served[2] += hits
            self._served[3] += host_bytes > 0
            self._served[4] += host_bytes
            self._served[5] += peer_bytes > 0
            self._served[6] += peer_bytes

    def _served_outside(self) -> tuple[int, int, int]:
        reads, nbytes, hits = self._served[:3]
        return reads, nbytes, hits

    def statistics(self) -> ReadStatistics:
        """The Reader's counters, reads answered outside the loop included."""
        self.check()
        with boundary():
            s = trio.from_thread.run_sync(self.reader.statistics, trio_token=self._token)
        with self._lock:
            hits, nbytes, peer_hits, peer_bytes = self._served[3:7]
        return dataclasses.replace(s, host_hits=s.host_hits + hits, host_bytes=s.host_bytes + nbytes,
                                   peer_hits=s.peer_hits + peer_hits,
                                   peer_bytes=s.peer_bytes + peer_bytes)


def _settle(future: asyncio.Future[outcome.Outcome[Any]], o: outcome.Outcome[Any]) -> None:
    """The outcome into an asyncio caller's future, unless the caller gave up on it."""
    if not future.done():
        future.set_result(o)


def _peer_wait(cfg: Config, index: ManifestIndex, peers: Any) -> PeerWait | None:
    """The library's native fetch of small files' extents from peers, when it can be
    (a cluster with the soft provider's C API and ``cluster.native_fetch``), else None."""
    from ..cluster import peer_wait
    if peers is None or not cfg.cluster.native_fetch or not peer_wait.available():
        return None
    try:
        return peer_wait.PeerWait(peers, index, index.chunk_size // SMALL_FILE_DIVISOR)
    except (OSError, RuntimeError) as e:
        log.info("no native fetch for small files from peers: %s", e)
        return None
