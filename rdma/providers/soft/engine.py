"""The Python owner of one native soft-RDMA engine (``rdma._soft_engine.Engine``).

One engine per opened soft device: it listens on the device's IPv4 address (ephemeral
port, published as ``PortAttr.service_port`` / ``ConnInfo.service_port``) and runs one
native thread that serves one-sided READs and moves data between sockets and registered
memory without the GIL.  The verbs objects (``pd.py`` … ``qp.py``) hold handles (MR key,
CQ id, QPN) into it, never pointers, so a stale handle is an error, not a crash.

This wrapper's jobs are the ones that need Python: turning the native ``OSError`` into
the :mod:`rdma.errors` tree at this one boundary, logging, and the blocking TCP connect
+ HELLO of ``to_rtr`` (a Python socket with a timeout, then the fd is handed over).
"""
from __future__ import annotations

import errno
import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ...errors import ConnectError, RdmaError, from_oserror
from ...tuning import CONNECT_TIMEOUT_S
from . import wire

log = logging.getLogger(__name__)

T = TypeVar("T")


def native() -> Any:
    """Import the extension lazily; a checkout without a build gets EOPNOTSUPP, not a crash."""
    try:
        from ... import _soft_engine
    except ImportError as exc:  # pragma: no cover - only without a build
        from ...errors import NotSupportedError
        raise NotSupportedError(f"soft provider engine not built ({exc}); run "
                                "`python setup.py build_ext --inplace`") from exc
    return _soft_engine


@dataclass(frozen=True)
class EngineStats:
    """Counters of one soft device's engine (read-only snapshot)."""

    #: connections the engine dropped: hostile/malformed input, HELLO timeouts, broken
    #: sockets, transport timeouts
    dropped_conns: int
    rx_bytes: int
    tx_bytes: int
    #: open connections (incl. accepted, not yet routed) and live QPs
    conns: int
    qps: int
    #: accepted connections still owing their HELLO (capped: native/soft_engine.h)
    pending_hello: int = 0
    #: pending connections closed to make room (per-source or total cap), closed for
    #: not sending a HELLO in time, and HELLOs refused (no such QP, not its peer, busy)
    hello_evicted: int = 0
    hello_timeouts: int = 0
    hello_refused: int = 0
    #: posts whose requests the engine thread sent (a busy QP's, or a chunk-sized READ:
    #: native/soft_engine.c, "Requester"); the rest were sent inline by the poster
    doorbell_posts: int = 0


class Engine:
    """One native engine; ``close()`` stops its thread and frees everything it holds."""

    def __init__(self, ip: str) -> None:
        self.ip = ip
        try:
            self._n = native().Engine(ip)
        except OSError as exc:
            raise from_oserror(exc, f"soft engine on {ip}") from exc
        self.port: int = self._n.port
        self._lock = threading.Lock()
        self._closed = False
        log.debug("soft engine listening on %s:%d", ip, self.port)

    def call(self, what: str, fn: Callable[..., T], *args: Any,
             error: type[RdmaError] | None = None) -> T:
        """Run a native method; OSError becomes ``error`` (or the tree's default class)."""
        try:
            return fn(*args)
        except OSError as exc:
            why = str(exc.strerror or exc)
            msg = why if why.startswith(what) else f"{what}: {why}"
            if error is not None:
                raise error(msg, exc.errno) from exc
            cls = type(from_oserror(exc, what))   # the tree decides the class, we the text
            raise cls(msg, exc.errno) from exc

    @property
    def raw(self) -> Any:
        """The native object (for the verbs objects of this package only)."""
        return self._n

    def stats(self) -> EngineStats:
        return EngineStats(**self._n.stats())

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._n.close()

    def connect(self, local_ip: str, remote_ip: str, remote_port: int, dest_qpn: int,
                src_qpn: int, private_data: bytes, timeout: float = CONNECT_TIMEOUT_S) -> int:
        """TCP connect from ``local_ip`` to the remote device's listener, send HELLO, wait
        for its answer; returns the connected fd (ownership passes to the caller).

        Raises :class:`ConnectError` (ECONNREFUSED when the remote QP refused: unknown,
        busy or in ERR; ETIMEDOUT when nothing answered)."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(timeout)
            sock.bind((local_ip, 0))
            sock.connect((remote_ip, remote_port))
            sock.sendall(wire.hello(dest_qpn, src_qpn, private_data))
            reply = b""
            while len(reply) < wire.HDR_LEN:
                chunk = sock.recv(wire.HDR_LEN - len(reply))
                if not chunk:
                    raise ConnectError(f"{remote_ip}:{remote_port} closed during HELLO "
                                       f"(QP {dest_qpn:#x} refused)", errno.ECONNREFUSED)
                reply += chunk
            hdr = wire.Header.unpack(reply)
            if hdr.magic != wire.MAGIC or hdr.opcode != wire.OP_HELLO:
                raise ConnectError(f"{remote_ip}:{remote_port} is not a soft RDMA device",
                                   errno.EPROTO)
            if hdr.status != 0:
                raise ConnectError(f"remote QP {dest_qpn:#x} at {remote_ip}:{remote_port} "
                                   "refused the connection (unknown, busy or in ERR)",
                                   errno.ECONNREFUSED)
            sock.setblocking(False)
            return sock.detach()
        except TimeoutError as exc:
            raise ConnectError(f"connect to {remote_ip}:{remote_port} timed out after "
                               f"{timeout}s", errno.ETIMEDOUT) from exc
        except OSError as exc:
            raise from_oserror(exc, f"connect to {remote_ip}:{remote_port}") from exc
        finally:
            if sock.fileno() >= 0:
                sock.close()
