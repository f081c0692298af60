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
"""
from __future__ import annotations

import errno
import functools
import logging
import time
from typing import Any, Awaitable, Callable, Protocol, TypeVar

import pyfuse3

from rdma.errors import RdmaError

from ..errors import ChunkUnavailable, ErrnoError, ReadOnly, SourceChanged

log = logging.getLogger(__name__)
access = logging.getLogger("kspeedfs.access")

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


class Handlers(Protocol):
    """What ``@fuse_op`` needs of the object whose methods it wraps."""

    slow_op: float   # seconds: slower operations are logged as WARNINGs (``log.slow_op``)


def fuse_op(fn: F) -> F:
    """Wrap the FUSE handler ``fn(self, ...)``: errors become ``FUSEError(errno)``, and
    each call is access-logged, as a WARNING when it took over ``self.slow_op`` seconds."""
    name = fn.__name__

    @functools.wraps(fn)
    async def wrapper(self: Handlers, *args: Any, **kwargs: Any) -> Any:
        t0 = time.monotonic()
        err = 0
        try:
            return await fn(self, *args, **kwargs)
        except pyfuse3.FUSEError as e:
            err = e.errno
            raise
        except ErrnoError as e:         # kspeedfs.errors and rdma.errors alike
            err = e.errno
            if isinstance(e, (SourceChanged, ChunkUnavailable, RdmaError)):
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
            if dt > self.slow_op:
                access.warning("slow operation: %s took %.3fs (errno %d)", name, dt, err)
            elif access.isEnabledFor(logging.DEBUG):
                access.debug("%s%r errno=%d %.6fs", name, args, err, dt)

    return wrapper  # type: ignore[return-value]
