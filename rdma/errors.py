"""The one exception tree of the ``rdma`` package.

Every error carries an ``errno`` (like ``PyverbsRDMAError(msg, error_code)``), so the
layer above can map it once, at its own boundary.  The tree separates *you did it* from
*the world did it*, as trio separates ``ClosedResourceError`` from ``BrokenResourceError``:

``RdmaError`` (errno)
  ``RdmaUserError``        EINVAL   bad arguments / attributes from the caller
    ``QPStateError``       EINVAL   illegal QP transition; names current and requested state
    ``QPAttrError``        EINVAL   a transition is missing required attributes (names them)
  ``PostError``            EINVAL/ENOMEM  ibv_post_send/ibv_post_recv refused the WR
  ``ResourceClosedError``  EBADF    *your* code closed this object (or its parent) already
  ``ResourceBusyError``    EBUSY
  ``NotSupportedError``    EOPNOTSUPP  the provider does not implement this (tests skip on it)
  ``NoDeviceError``        ENODEV
  ``ConnectError``         ETIMEDOUT/ECONNREFUSED/...  the remote could not be reached
                                    (to_rtr on the soft provider; like rxe's ETIMEDOUT)
  ``WCError``              EIO      a work completion failed; ``.wc`` is the WC and
                                    ``.status`` its ibv_wc_status.  Raised only by
                                    helpers that *ask* for it (``WC.raise_for_status``).

Failed completions are data, not exceptions: ``CQ.poll`` returns WCs whatever their status.
"""
from __future__ import annotations

import errno as _errno
import os
from typing import Any

from .enums import wc_status_str


class RdmaError(Exception):
    """Base class.  ``errno`` is a positive errno value; ``str()`` includes strerror."""

    default_errno: int = _errno.EIO

    def __init__(self, msg: str, errno: int | None = None) -> None:
        self.errno = self.default_errno if errno is None else abs(errno)
        self.msg = msg
        super().__init__(f"{msg}. Errno: {self.errno}, {os.strerror(self.errno)}")


class RdmaUserError(RdmaError):
    default_errno = _errno.EINVAL


class QPStateError(RdmaUserError):
    """Illegal QP state transition (``ibv_modify_qp`` → EINVAL)."""

    def __init__(self, current: Any, requested: Any, msg: str | None = None) -> None:
        self.current = current
        self.requested = requested
        name_c = getattr(current, "name", current)
        name_r = getattr(requested, "name", requested)
        super().__init__(msg or f"illegal QP transition {name_c} -> {name_r}")


class QPAttrError(RdmaUserError):
    """A transition was requested without the attributes the state table requires."""

    def __init__(self, current: Any, requested: Any, missing: set[str] | frozenset[str],
                 extra: set[str] | frozenset[str] = frozenset()) -> None:
        self.current, self.requested = current, requested
        self.missing, self.extra = frozenset(missing), frozenset(extra)
        parts = []
        if self.missing:
            parts.append(f"missing required {sorted(self.missing)}")
        if self.extra:
            parts.append(f"not allowed {sorted(self.extra)}")
        super().__init__(f"QP {getattr(current, 'name', current)} -> "
                         f"{getattr(requested, 'name', requested)}: " + "; ".join(parts))


class PostError(RdmaError):
    """``ibv_post_send``/``ibv_post_recv`` returned an error (EINVAL: QP not in a state that
    accepts the WR, or a malformed WR; ENOMEM: queue full)."""

    default_errno = _errno.EINVAL


class ResourceClosedError(RdmaError):
    """*You* closed this object (or a parent, which closes its children).  You do **not** get
    this error when the remote side failed; that shows up as failed WCs and ERR state."""

    default_errno = _errno.EBADF


class ResourceBusyError(RdmaError):
    default_errno = _errno.EBUSY


class NotSupportedError(RdmaError):
    default_errno = _errno.EOPNOTSUPP


class NoDeviceError(RdmaError):
    default_errno = _errno.ENODEV


class ConnectError(RdmaError):
    """The world failed while connecting: remote unreachable, refused, or timed out."""

    default_errno = _errno.ETIMEDOUT


class WCError(RdmaError):
    """A work completion with ``status != IBV_WC_SUCCESS``."""

    def __init__(self, wc: Any) -> None:
        self.wc = wc
        self.status = wc.status
        super().__init__(f"WC wr_id={wc.wr_id} failed: {wc_status_str(wc.status)} "
                         f"({getattr(wc.status, 'name', wc.status)})", _errno.EIO)


def from_oserror(exc: OSError, what: str) -> RdmaError:
    """Map an ``OSError`` raised by a provider's native layer onto the tree."""
    code = exc.errno or _errno.EIO
    cls: type[RdmaError]
    if code == _errno.EOPNOTSUPP:
        cls = NotSupportedError
    elif code == _errno.EBADF:
        cls = ResourceClosedError
    elif code == _errno.EBUSY:
        cls = ResourceBusyError
    elif code in (_errno.ETIMEDOUT, _errno.ECONNREFUSED, _errno.EHOSTUNREACH,
                  _errno.ENETUNREACH, _errno.ECONNRESET):
        cls = ConnectError
    else:
        cls = RdmaError
    return cls(f"{what}: {exc.strerror or exc}", code)


# --------------------------------------------------------------------- vRDMA (rdma.vrdma)
# Same split as above: PathClosed is *you* closed it; PathBroken and PeerUnreachable are the
# world failing, with the failed WC's WCError (or the OSError) in ``__cause__``.

class PathClosed(ResourceClosedError):
    """*Your* code closed this vRDMA path / virtual QP / endpoint (``close()`` was called)."""


class PathBroken(RdmaError):
    """One physical path (local NIC × remote NIC) failed: a failed WC or missed heartbeats.
    Internal to :mod:`rdma.vrdma` (its READs are re-posted on another path); callers of a
    virtual QP see it only as ``__cause__`` of :class:`PeerUnreachable`."""

    default_errno = _errno.ECONNRESET


class PeerUnreachable(RdmaError):
    """Every path to the peer has been dead for longer than the configured bound, or the
    peer is gone: the caller should go to another replica.  ``peer`` names it."""

    default_errno = _errno.EHOSTUNREACH

    def __init__(self, msg: str, peer: str = "", errno: int | None = None) -> None:
        self.peer = peer
        super().__init__(msg, errno)


class HandshakeError(RdmaError):
    """The vRDMA control-channel handshake failed (malformed, wrong version, cut short)."""

    default_errno = _errno.EPROTO


class AuthenticationError(HandshakeError):
    """The other end did not prove knowledge of the cluster's shared secret (bad HMAC)."""

    default_errno = _errno.EACCES
