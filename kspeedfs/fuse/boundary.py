"""The one place kspeedfs errors become ``FUSEError(errno)``.

``@fuse_op`` wraps every handler in ``operations.py``: an error of either tree
(:class:`~kspeedfs.errors.KspeedfsError`, ``rdma.errors.RdmaError``: both
:class:`~rdma.errors.ErrnoError`) is answered with its ``err.errno`` (and logged at the
level its kind deserves), anything else is a bug: logged with a traceback and answered
with EIO, never left to kill the daemon.
It also keeps the per-operation access log: each request's name, errno and duration
at DEBUG, and a WARNING for operations slower than ``log.slow_op``, which the
handler's object holds as ``slow_op`` (``Operations`` takes it from the config): the
threshold is read per call from ``self``, never from a module global.

Per-operation counters for the metrics exporter (``kspeedfs/metrics.py``) live here too:
:class:`OpStats`, one row of plain ints per operation (count, errors, seconds, and a
fixed-bucket latency histogram), held by the handler's object as ``op_stats``; the
wrapper adds to it, the exporter reads it at scrape time. A row is made for every
wrapped name when the object's ``OpStats`` is created, so the dict never grows.
"""
from __future__ import annotations

import bisect
import errno
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

import pyfuse3

from rdma.errors import RdmaError

from ..errors import ChunkUnavailable, ErrnoError, ManifestCorrupt, ReadOnly, SourceChanged

log = logging.getLogger(__name__)
access = logging.getLogger("kspeedfs.access")

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])

OPS: list[str] = []     # every name @fuse_op wrapped, in order


class OpStats:
    """Per-operation counters: ``rows[name] = [count, errors, seconds, *buckets]``.

    ``buckets[i]`` counts operations that took at most ``BOUNDS[i]`` seconds (and more
    than the bound before it); the last one counts the slower rest. Not cumulative:
    the exporter sums them at scrape time. Mutated only from the trio thread."""

    BOUNDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
              0.25, 0.5, 1.0, 2.5, 10.0)

    def __init__(self) -> None:
        self.rows: dict[str, list[Any]] = {name: [0, 0, 0.0] + [0] * (len(self.BOUNDS) + 1)
                                           for name in OPS}

    def record(self, name: str, dt: float, err: int) -> None:
        row = self.rows.get(name)
        if row is None:               # a handler wrapped after this object was made
            row = self.rows[name] = [0, 0, 0.0] + [0] * (len(self.BOUNDS) + 1)
        row[0] += 1
        row[2] += dt
        row[3 + bisect.bisect_left(self.BOUNDS, dt)] += 1
        if err:
            row[1] += 1


class Handlers(Protocol):
    """What ``@fuse_op`` needs of the object whose methods it wraps."""

    slow_op: float   # seconds: slower operations are logged as WARNINGs (``log.slow_op``)
    # optional: ``op_stats: OpStats``, counted per call when present (the metrics exporter)
    # optional: ``index`` (a ManifestIndex): once its page map failed, every answer is EIO


def _check_pages(handlers: Handlers) -> None:
    """Fail closed once a manifest page could not be loaded: the page reads as zeros
    (``manifest/pager.py``), so any answer computed since may be wrong; checked after
    the handler ran, so its own touches count."""
    index = getattr(handlers, "index", None)
    pages = getattr(index, "pages", None)
    if pages is not None and pages.failure:
        raise ManifestCorrupt(f"the manifest is unreadable: {pages.failure}")


def fuse_op(fn: F) -> F:
    """Wrap the FUSE handler ``fn(self, ...)``: errors become ``FUSEError(errno)``, and
    each call is access-logged, as a WARNING when it took over ``self.slow_op`` seconds.

    A request that waited before its handler ran (the native engine's queue) passes
    ``since=`` its arrival (``time.monotonic``'s clock): its latency, its histogram bucket
    and the slow-operation warning count from then, as the reader saw it."""
    name = fn.__name__
    OPS.append(name)

    @functools.wraps(fn)
    async def wrapper(self: Handlers, *args: Any, since: float | None = None,
                      **kwargs: Any) -> Any:
        t0 = time.monotonic() if since is None else since
        err = 0
        try:
            try:
                return await fn(self, *args, **kwargs)
            finally:
                _check_pages(self)      # its error supersedes the handler's own
        except pyfuse3.FUSEError as e:
            err = e.errno
            raise
        except ErrnoError as e:         # kspeedfs.errors and rdma.errors alike
            err = e.errno
            if isinstance(e, (SourceChanged, ChunkUnavailable, RdmaError, ManifestCorrupt)):
                log.error("%s: %s", name, e)
            elif not isinstance(e, ReadOnly):
                log.info("%s: %s", name, e)
            raise pyfuse3.FUSEError(e.errno) from None
        except Exception:
            err = errno.EIO
            log.exception("%s: unexpected error, answering EIO", name)
            raise pyfuse3.FUSEError(errno.EIO) from None
        finally:
            dt = time.monotonic() - t0
            stats = getattr(self, "op_stats", None)
            if stats is not None:
                stats.record(name, dt, err)
            if dt > self.slow_op:
                access.warning("slow operation: %s took %.3fs (errno %d)", name, dt, err)
            elif access.isEnabledFor(logging.DEBUG):
                access.debug("%s%r errno=%d %.6fs", name, args, err, dt)

    return wrapper  # type: ignore[return-value]
