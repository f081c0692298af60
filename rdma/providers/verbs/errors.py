"""The one place pyverbs exceptions become :mod:`rdma.errors` (errno kept)."""
from __future__ import annotations

import contextlib
import errno as _errno
from collections.abc import Iterator

from pyverbs.pyverbs_error import PyverbsError, PyverbsRDMAError

from ...errors import (
    ConnectError,
    NoDeviceError,
    NotSupportedError,
    RdmaError,
    RdmaUserError,
    ResourceBusyError,
)

_BY_ERRNO: dict[int, type[RdmaError]] = {
    _errno.EOPNOTSUPP: NotSupportedError, _errno.ENOSYS: NotSupportedError,
    _errno.EBUSY: ResourceBusyError, _errno.ENODEV: NoDeviceError,
    _errno.EINVAL: RdmaUserError,
    # to_rtr on RoCE resolves the peer's MAC: ETIMEDOUT/ENETUNREACH when it cannot
    _errno.ETIMEDOUT: ConnectError, _errno.ENETUNREACH: ConnectError,
    _errno.EHOSTUNREACH: ConnectError,
}


def errno_of(exc: PyverbsError) -> int:
    code = getattr(exc, "error_code", 0) or 0
    return abs(code) or _errno.EIO


@contextlib.contextmanager
def mapped(what: str, error: type[RdmaError] | None = None) -> Iterator[None]:
    """Run a pyverbs call; PyverbsError becomes ``error`` (or the class for its errno)."""
    try:
        yield
    except PyverbsRDMAError as exc:
        code = errno_of(exc)
        cls = error or _BY_ERRNO.get(code, RdmaError)
        raise cls(f"{what}: {exc}", code) from exc
    except PyverbsError as exc:     # PyverbsUserError: bad arguments on our side
        raise (error or RdmaUserError)(f"{what}: {exc}", _errno.EINVAL) from exc
