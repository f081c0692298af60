"""The node's ask socket: a mount's page map asks its host's node for a page it lacks.

A node's page copy (``page_copy.py``) holds every page of the versions it preloaded,
but not of a version it does not preload, nor a page a sweep or an operator removed. The
page map's fault handler (``native/manifest_pager.c``, C only: the faulting thread may
hold the GIL) then asks the node over a unix stream socket in the copy,
``<cluster.page_copy>/.ask`` (the wire format: ``manifest/ask.py``)::

    page map (C, mount)                       node (this module)
      connect, send  hash ‖ length
                                              parse_ask → PageCopy.fetch_one:
                                                 copy? → peers → store.pages, verified,
                                                 written to the copy
      recv  1 byte: OK written, NONE not      ◄──
      then the dirs again (the copy first)

Bounds: the request must come whole within ``ASK_READ`` seconds; ``workers`` asks are
served at once (the rest wait in the listen backlog, and the mount's ``ask_ms`` bounds
its wait); each is given ``ASK_DEADLINE`` seconds. The socket lives in the copy's 0700
directory: only the node's user (root, as mounts are) may ask. The page is verified by
the node before it is written and by the page map when it reads it.
"""
from __future__ import annotations

import logging
import os
import socket

import trio

from ..errors import KspeedfsError
from ..manifest.ask import NONE, OK, REQUEST, ask_path, parse_ask
from ..tuning import ASK_DEADLINE, ASK_READ
from .page_copy import PageCopy

log = logging.getLogger(__name__)

class PageAsks:
    """Serves the ask socket of ``pages`` (:meth:`serve`), once its directory exists.

    Contract: every connection gets at most one answer byte, 0 only once the page is in
    the copy, verified; a malformed or slow request is closed unanswered. Trio thread."""

    def __init__(self, pages: PageCopy) -> None:
        self.pages = pages
        self._limit = trio.CapacityLimiter(pages.workers)

    async def serve(self) -> None:
        """Listen on ``<copy>/.ask`` from the first fill on (the copy is made lazily)
        until cancelled."""
        await self.pages.checked.wait()
        path = ask_path(self.pages.directory)
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            os.unlink(path)                    # a stale socket of an earlier run
        except FileNotFoundError:
            pass
        try:
            await sock.bind(path)
        except OSError as e:                   # a path too long for a unix socket, say
            log.error("page copy: no ask socket at %s (%s): mounts here read only what "
                      "the copy holds", path, e)
            sock.close()
            return
        sock.listen(128)
        log.info("page copy: asks answered on %s", path)
        await trio.serve_listeners(self._conn, [trio.SocketListener(sock)])

    async def _conn(self, stream: trio.SocketStream) -> None:
        async with stream:
            raw = b""
            with trio.move_on_after(ASK_READ):
                while len(raw) < REQUEST:
                    got = await stream.receive_some(REQUEST - len(raw))
                    if not got:
                        break
                    raw += got
            try:
                digest, length = parse_ask(raw)
            except KspeedfsError as e:
                log.warning("page copy: %s", e)
                return
            answer = NONE
            async with self._limit:
                with trio.move_on_after(ASK_DEADLINE):
                    try:
                        await self.pages.fetch_one(digest, length)
                        answer = OK
                    except KspeedfsError as e:
                        log.warning("page copy: a mount asked for page %s: %s",
                                    digest.hex(), e)
            try:
                await stream.send_all(answer)
            except trio.BrokenResourceError:
                pass                           # the page map gave up waiting (ask_ms)
