"""The Python library's one error boundary (docs/api.md, "Errors"): every error a public
call of ``client.py`` raises is what ``open()`` and ``read()`` on the mount raise for the
same file, as ``fuse/boundary.py`` makes it for the mount.

    boundary(path)        around a public call: ``mapped`` of what escapes it
    mapped(e, path)       kspeedfs and rdma errors → OSError(e.errno); OSError,
                          ValueError, RuntimeError as they are; a bug → logged, EIO
    oserror(code, path)   the OSError a check raises itself (ENOENT, EISDIR, EROFS, …)
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections.abc import Iterator

from ..errors import ErrnoError

__all__ = ["PathLike", "boundary", "mapped", "oserror"]

log = logging.getLogger(__name__)

#: a path as callers give it: relative to the dataset's root, ``str`` or ``bytes``
PathLike = str | bytes | os.PathLike[str]


@contextlib.contextmanager
def boundary(path: PathLike | None = None) -> Iterator[None]:
    """The library's one error boundary (``mapped``) around a public call."""
    try:
        yield
    except Exception as e:
        out = mapped(e, path)
        if out is e:
            raise
        raise out from e


def mapped(e: Exception, path: PathLike | None) -> Exception:
    """What ``open()``/``read()`` on the mount would raise for ``e``: kspeedfs and rdma
    errors become ``OSError(e.errno)`` (which picks the subclass: ENOENT is
    FileNotFoundError); OSError, ValueError and RuntimeError stay; anything else is a bug,
    logged with its traceback, and EIO."""
    if isinstance(e, ErrnoError):
        return OSError(e.errno, str(e), _show(path))
    if isinstance(e, (OSError, ValueError, RuntimeError)):
        return e
    log.error("unexpected error reading %s, raising EIO", _show(path), exc_info=e)
    return OSError(errno.EIO, f"unexpected error: {e!r}", _show(path))


def oserror(code: int, path: PathLike) -> OSError:
    """``OSError(code)`` for ``path``, with the system's message (ENOENT is
    FileNotFoundError)."""
    return OSError(code, os.strerror(code), _show(path))


def _show(path: PathLike | None) -> str | None:
    return None if path is None else os.fsdecode(path)
