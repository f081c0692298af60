"""The one place kspeedfs errors become ``FUSEError(errno)``.

``@fuse_op`` wraps every handler in ``operations.py``: a :class:`KspeedfsError` is
turned into its errno (and logged at the level its kind deserves), anything else is
a bug: logged with a traceback and answered with EIO, never left to kill the daemon.
It also keeps the per-operation access log: each request's name, errno and duration
at DEBUG, and a WARNING for operations slower than ``log.slow_op``.
"""
from __future__ import annotations

import errno
import functools
import logging
import time
from typing import Any, Awaitable, Callable, TypeVar

import pyfuse3

from ..errors import ChunkUnavailable, KspeedfsError, ReadOnly, SourceChanged

log = logging.getLogger(__name__)
access = logging.getLogger("kspeedfs.access")

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])

SLOW_OP = 1.0  # seconds; daemon.py sets it from log.slow_op


def fuse_op(fn: F) -> F:
    name = fn.__name__

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.monotonic()
        err = 0
        try:
            return await fn(*args, **kwargs)
        except pyfuse3.FUSEError as e:
            err = e.errno
            raise
        except KspeedfsError as e:
            err = e.errno
            if isinstance(e, (SourceChanged, ChunkUnavailable)):
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
            if dt > SLOW_OP:
                access.warning("slow operation: %s took %.3fs (errno %d)", name, dt, err)
            elif access.isEnabledFor(logging.DEBUG):
                access.debug("%s%r errno=%d %.6fs", name, args[1:], err, dt)

    return wrapper  # type: ignore[return-value]
