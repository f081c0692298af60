"""① The pump of the native engine's queue: ``Engine.take()``'s events, dispatched by kind.

    Read       a READ C did not answer: handed back to C with the native fetch
               (``Reader.hand_off``), else ``Replies.answer_read`` in a task of its own
    Getxattr   ``Replies.answer_getxattr``, a task
    Listxattr  ``Replies.answer_listxattr``, a task
    Prefetch   a sequential reader's chunks: ``Reader.reached``, ``Reader.prefetch``
    Fetched    a native fetch that ended or is late: ``NativeFetch.fetched``

(one structseq type per kind: native/fuse_events_py.c)
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import trio

from .connection import _engine

if TYPE_CHECKING:
    from ..cluster.native.fetch import NativeFetch
    from ..reader import Reader
    from .replies import Replies

#: events per take(): the binding's own bound (MAX_TAKE)
TAKE = 1024


class EventPump:
    """Takes the engine's queue on the trio thread and hands each event on.

    ``await run(engine, nursery)`` waits on the engine's eventfd and dispatches until the
    C threads have ended; ``await drain(engine, nursery)`` answers what they queued last
    (after a handover). Requests that need an answer run as tasks in ``nursery``; hints
    and fetch events are handled inline. Owns nothing but the reference to the native
    fetch (``fetch``), set once the mount reads from peers, possibly while it runs.
    """

    def __init__(self, reader: Reader, replies: Replies) -> None:
        self.reader = reader
        self.replies = replies
        #: the chunk fetch in C (cluster/native/fetch.py), when the mount reads from peers
        self.fetch: NativeFetch | None = None

    async def run(self, engine: Any, nursery: trio.Nursery) -> None:
        """Dispatch the queue until the engine's threads have ended (the connection is
        gone, or a successor took it over)."""
        efd = engine.eventfd
        while True:
            await trio.lowlevel.wait_readable(efd)
            try:
                os.read(efd, 8)
            except BlockingIOError:
                pass
            self._take_all(engine, nursery)
            engine.reap()
            if not engine.running:
                return

    async def drain(self, engine: Any, nursery: trio.Nursery) -> None:
        """After a handover: the native fetch closed (its parked READs answered, or
        queued), then what the last threads queued dispatched."""
        if self.fetch is not None:
            await self.fetch.aclose()
        self._take_all(engine, nursery)

    def _take_all(self, engine: Any, nursery: trio.Nursery) -> None:
        while batch := engine.take(TAKE):
            for ev in batch:
                self.dispatch(nursery, ev)

    def dispatch(self, nursery: trio.Nursery, ev: Any) -> None:
        """Hand event ``ev`` (one of take()'s named types) on; answers start in
        ``nursery``."""
        kind = type(ev)
        if kind is _engine.Read:
            # a small file or a block from a peer: C READs and answers it, so the READ
            # needs no task of its own, and asking here spares the trio thread spawning one
            # (docs/design.md, "The native chunk fetch": small files and random blocks)
            if self.fetch is None or not self.reader.hand_off(
                    ev.entry, (ev.fd, ev.unique, ev.offset, ev.size, ev.random, ev.since)):
                nursery.start_soon(self.replies.answer_read, ev.fd, ev.unique, ev.entry,
                                   ev.offset, ev.size, ev.random, ev.since)
        elif kind is _engine.Prefetch:
            self.reader.reached(ev.reached)
            for k in range(ev.first, ev.stop):
                self.reader.prefetch(ev.entry, k)
        elif kind is _engine.Fetched:
            if self.fetch is not None:
                self.fetch.fetched(ev.cookie, ev.chunk, ev.status, ev.slot, ev.peer, ev.path,
                                   ev.since)
        elif kind is _engine.Getxattr:
            nursery.start_soon(self.replies.answer_getxattr, ev.fd, ev.unique, ev.entry,
                               ev.name, ev.size, ev.since)
        elif kind is _engine.Listxattr:
            nursery.start_soon(self.replies.answer_listxattr, ev.fd, ev.unique, ev.entry,
                               ev.size, ev.since)
