"""The one exception tree of the ``rdma`` package, and the base both trees share.

The rule, for this tree and for ``kspeedfs.errors`` (which builds on :class:`ErrnoError`
so that ``rdma`` never imports ``kspeedfs``):

* Every error is an :class:`ErrnoError` and carries an int ``errno``: a class default,
  given in the class statement (``class NoDeviceError(RdmaError, errno=ENODEV)``) and
  inherited, which one instance may override (``RdmaError(msg, errno)``, as pyverbs'
  ``PyverbsRDMAError(msg, error_code)``: the code the native layer returned).
* The underlying failure (the ``OSError``, the failed WC's :class:`WCError`) is chained
  as ``__cause__`` (``raise PathBroken(...) from wc_error``), not folded into the message.
* Each package maps its errors at exactly one boundary, and reads ``err.errno`` there
  and nowhere else: ``kspeedfs/fuse/boundary.py`` (``FUSEError(err.errno)``) and
  ``kspeedfs/cli/app.py`` (one line, exit status 1).

The tree separates *you did it* from *the world did it*, as trio separates
``ClosedResourceError`` from ``BrokenResourceError``: "closed" means *your* code closed
the object (:class:`ResourceClosedError`, :class:`PathClosed`); you do *not* get it when
the remote side or the network failed.  That is "broken" or "unreachable"
(:class:`PathBroken`, :class:`PeerUnreachable`, :class:`ConnectError`), with what failed
in ``__cause__``; you do *not* get those for an object you closed yourself.

``RdmaError`` (errno)
  ``RdmaUserError``        EINVAL   bad arguments / attributes from the caller
    ``QPStateError``       EINVAL   illegal QP transition; names current and requested state
    ``QPAttrError``        EINVAL   a transition is missing required attributes (names them)
  ``PostError``            EINVAL/ENOMEM  ibv_post_send/ibv_post_recv refused the WR
  ``ResourceClosedError``  EBADF    *your* code closed this object (or its parent) already
    ``PathClosed``         EBADF    *your* code closed this vRDMA path / virtual QP / endpoint
  ``ResourceBusyError``    EBUSY
  ``NotSupportedError``    EOPNOTSUPP  the provider does not implement this (tests skip on it)
  ``NoDeviceError``        ENODEV
  ``ConnectError``         ETIMEDOUT/ECONNREFUSED/...  the remote could not be reached
                                    (to_rtr on the soft provider; like rxe's ETIMEDOUT)
  ``WCError``              EIO      a work completion failed; ``.wc`` is the WC and
                                    ``.status`` its ibv_wc_status.  Raised only by
                                    helpers that *ask* for it (``WC.raise_for_status``).
  ``PathBroken``           ECONNRESET  the world broke one physical path (vRDMA internal)
  ``PeerUnreachable``      EHOSTUNREACH  every path to the peer is down: go to another replica
  ``HandshakeError``       EPROTO   the vRDMA control handshake failed
    ``AuthenticationError`` EACCES  the peer did not prove the cluster secret

Failed completions are data, not exceptions: ``CQ.poll`` returns WCs whatever their status.
"""
from __future__ import annotations

import errno as _errno
import os
from typing import Any

from .enums import wc_status_str


class ErrnoError(Exception):
    """An error that carries the errno it means: the base of both exception trees.

    ``errno`` is a positive int: the class default (set with ``errno=`` in the class
    statement, inherited otherwise; EIO at the root), or this instance's own when the
    constructor was given one.  What failed underneath goes in ``__cause__``.
    """

    errno: int = _errno.EIO

    def __init_subclass__(cls, errno: int | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if errno is not None:
            cls.errno = errno

    def __init__(self, *args: object, errno: int | None = None) -> None:
        super().__init__(*args)
        if errno:                       # None (or 0): the class default
            self.errno = abs(errno)


class RdmaError(ErrnoError):
    """Base of the rdma tree: ``RdmaError(msg, errno=None)``, like pyverbs'
    ``PyverbsRDMAError``; ``str()`` appends the errno and its strerror."""

    def __init__(self, msg: str, errno: int | None = None) -> None:
        super().__init__(msg, errno=errno)
        self.msg = msg
        self.args = (f"{msg}. Errno: {self.errno}, {os.strerror(self.errno)}",)


class RdmaUserError(RdmaError, errno=_errno.EINVAL):
    """Bad arguments or attributes from the caller."""


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


class PostError(RdmaError, errno=_errno.EINVAL):
    """``ibv_post_send``/``ibv_post_recv`` returned an error (EINVAL: QP not in a state that
    accepts the WR, or a malformed WR; ENOMEM: queue full)."""


class ResourceClosedError(RdmaError, errno=_errno.EBADF):
    """"Closed" means that *your* code closed this object (or a parent, which closes its
    children).  You do **not** get this error when the remote side failed; that shows up
    as failed WCs and ERR state (and in :mod:`rdma.vrdma`, as :class:`PathBroken`)."""


class ResourceBusyError(RdmaError, errno=_errno.EBUSY):
    """The provider reports the object busy (EBUSY; see ``from_oserror``)."""


class NotSupportedError(RdmaError, errno=_errno.EOPNOTSUPP):
    """The provider does not implement this (conformance tests skip on it)."""


class NoDeviceError(RdmaError, errno=_errno.ENODEV):
    """No device of the selected provider by that name or address."""


class ConnectError(RdmaError, errno=_errno.ETIMEDOUT):
    """The world failed while connecting: remote unreachable, refused, or timed out."""


class WCError(RdmaError):
    """A work completion with ``status != IBV_WC_SUCCESS``."""

    def __init__(self, wc: Any) -> None:
        self.wc = wc
        self.status = wc.status
        super().__init__(f"WC wr_id={wc.wr_id} failed: {wc_status_str(wc.status)} "
                         f"({getattr(wc.status, 'name', wc.status)})")


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
    """*Your* code closed this vRDMA path / virtual QP / endpoint (``close()`` was called).
    You do **not** get this when the world failed: that is :class:`PathBroken` or
    :class:`PeerUnreachable`."""


class PathBroken(RdmaError, errno=_errno.ECONNRESET):
    """The world broke one physical path (local NIC × remote NIC): a failed WC or missed
    heartbeats; the WC's :class:`WCError` (or the ``OSError``) is in ``__cause__``.  You do
    **not** get this if *you* closed the path (that is :class:`PathClosed`).  Internal to
    :mod:`rdma.vrdma` (its READs are re-posted on another path); callers of a virtual QP
    see it only as ``__cause__`` of :class:`PeerUnreachable`."""


class PeerUnreachable(RdmaError, errno=_errno.EHOSTUNREACH):
    """Every path to the peer has been dead for longer than the configured bound, or the
    peer is gone: the caller should go to another replica.  ``peer`` names it."""

    def __init__(self, msg: str, peer: str = "", errno: int | None = None) -> None:
        self.peer = peer
        super().__init__(msg, errno)


class HandshakeError(RdmaError, errno=_errno.EPROTO):
    """The vRDMA control-channel handshake failed (malformed, wrong version, cut short)."""


class AuthenticationError(HandshakeError, errno=_errno.EACCES):
    """The other end did not prove knowledge of the cluster's shared secret (bad HMAC)."""
