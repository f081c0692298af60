"""The ask socket's wire format: a process on a node's host asks that node for a manifest
page its directories lack.

The node serves it (``cluster/page_ask.py``); a mount's page map asks in C
(``native/manifest_pager.c``, which cannot share these constants: keep the two in step)
and ``load.py`` asks for the table pages through :func:`ask_page`::

    asker                                     node
      connect <copy>/.ask
      send  hash (32) ‖ length (8, little endian)
                                              page fetched, verified, written to the copy
      recv  1 byte: OK written, NONE not      ◄──

The socket lives in the node's page copy (``cluster.page_copy``), a 0700 directory: only
the node's user may ask.
"""
from __future__ import annotations

import logging
import os
import socket

from ..errors import KspeedfsError
from .pages import HASH_SIZE, MAX_PAGE

log = logging.getLogger(__name__)

#: the socket's name in the copy (not a page: the sweep reads only <hh>/ directories)
ASK_NAME = ".ask"
REQUEST = HASH_SIZE + 8
OK, NONE = b"\0", b"\1"


def ask_path(copy: str) -> str:
    """Where the node owning page copy ``copy`` listens."""
    return os.path.join(copy, ASK_NAME)


def ask_request(digest: bytes, length: int) -> bytes:
    """The request for page ``digest`` of ``length`` bytes."""
    return digest + length.to_bytes(8, "little")


def parse_ask(raw: bytes) -> tuple[bytes, int]:
    """A request (untrusted bytes) → (hash, length); ``KspeedfsError`` unless it is 40
    bytes with a length in 1..MAX_PAGE."""
    if len(raw) != REQUEST:
        raise KspeedfsError(f"page ask of {len(raw)} bytes, not {REQUEST}")
    length = int.from_bytes(raw[HASH_SIZE:], "little")
    if not 1 <= length <= MAX_PAGE:
        raise KspeedfsError(f"page ask for {length} bytes (1..{MAX_PAGE})")
    return raw[:HASH_SIZE], length


def ask_page(ask: str, digest: bytes, length: int, timeout: float) -> bool:
    """Ask the node listening on ``ask`` to put page ``digest`` (``length`` bytes) in its
    copy, waiting up to ``timeout`` seconds: whether it says it did."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(ask)
            s.sendall(ask_request(digest, length))
            return s.recv(1) == OK
    except OSError as e:
        log.warning("asking the node for manifest page %s: %s", digest.hex(), e)
        return False
