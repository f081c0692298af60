"""The parts of one read (its chunks, a chunk's blocks) loaded concurrently, with a
kspeedfs error raised as itself: the FUSE boundary and the library map it to its errno,
which they could not do inside a nursery's ExceptionGroup.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import trio

from .errors import KspeedfsError


async def each(fn: Callable[..., Awaitable[None]], args: Iterable[tuple[Any, ...]]) -> None:
    """``fn(*a)`` for every ``a``, concurrently. A kspeedfs error is raised as itself,
    not inside the nursery's ExceptionGroup, so the FUSE boundary maps it to its errno
    (a changed source file is EIO with its name logged, not an "unexpected error")."""
    try:
        async with trio.open_nursery() as n:
            for a in args:
                n.start_soon(fn, *a)
    except BaseExceptionGroup as group:
        mine, rest = group.split(KspeedfsError)
        if mine is not None and rest is None:
            first = mine.exceptions[0]
            while isinstance(first, BaseExceptionGroup):
                first = first.exceptions[0]
            raise first from None
        raise
