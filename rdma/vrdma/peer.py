"""What a virtual QP knows of its peer: node, port, incarnation, NICs, heartbeat words, vMRs.

Filled from the peer's ``info`` reply at bootstrap (:meth:`Endpoint.connect`) and
refreshed by every path (re)build, whose reply carries the same fields
(:meth:`Peer.update`): a peer that restarted shows a new incarnation there, and the
heartbeat of the rebuilt path compares against it (:mod:`.monitor`).  Exported vMRs are
only ever added, never forgotten: a READ against a vMR the peer stopped exporting fails
on the wire (REM_ACCESS_ERR, the caller's error), not here.

:meth:`Peer.check` parses a reply the way :meth:`Peer.update` reads it and keeps
nothing: the endpoint runs it on every untrusted ``info`` reply before using it.
"""
from __future__ import annotations

from typing import Any

from ..errors import RdmaUserError
from .vmr import RemoteVMR


class Peer:
    """The peer of one virtual QP, as its latest ``info``/``path`` reply described it.

    Attributes:
        node: the peer endpoint's node name.
        port: its listener port (every path's control connection goes there).
        incarnation: the peer's heartbeat word; a probe reading another value means the
            peer process restarted.
        nics: the peer's NIC addresses.
        control: per remote NIC, ``(addr, rkey)`` of its heartbeat word.
        remote_mrs: the vMRs it exports, by name (added to, never pruned).
    """

    def __init__(self, node: str, port: int, info: dict[str, Any]) -> None:
        self.node = node
        self.port = port
        self.remote_mrs: dict[str, RemoteVMR] = {}
        self.incarnation = 0
        self.nics: list[str] = []
        self.control: dict[str, tuple[int, int]] = {}
        self.update(info)

    def update(self, info: dict[str, Any]) -> None:
        """Take the fields of an ``info`` (or ``path``) reply.  Raises what a malformed
        reply makes it raise (LookupError, TypeError, ValueError, ...)."""
        self.incarnation = int(info["incarnation"])
        self.nics = [str(n) for n in info["nics"]]
        self.control = {str(n): (int(v[0]), int(v[1])) for n, v in info["control"].items()}
        for name, d in info.get("mrs", {}).items():
            self.remote_mrs[name] = RemoteVMR.from_dict(name, d)

    @staticmethod
    def check(info: Any) -> None:
        """Raise as :meth:`update` would on ``info``; keep nothing."""
        Peer("", 0, info)

    def remote_mr(self, name: str) -> RemoteVMR:
        """The vMR exported as ``name``; RdmaUserError if the peer exports none."""
        try:
            return self.remote_mrs[name]
        except KeyError:
            raise RdmaUserError(f"peer {self.node} exports no vMR {name!r} "
                                f"(known: {sorted(self.remote_mrs)})") from None

    def locate(self, remote_addr: int, length: int) -> tuple[RemoteVMR, int]:
        """The exported vMR holding ``[remote_addr, +length)`` and the offset in it."""
        for rm in self.remote_mrs.values():
            if rm.addr <= remote_addr and remote_addr + length <= rm.addr + rm.length:
                return rm, remote_addr - rm.addr
        raise RdmaUserError(f"[{remote_addr:#x}, +{length}) is in no vMR exported by "
                            f"{self.node}")
