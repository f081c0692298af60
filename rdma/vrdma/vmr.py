"""Virtual MRs: one buffer registered on every local NIC, and its remote description.

An RC QP belongs to one device, and an lkey/rkey to one device's PD, so a READ re-posted on
another NIC needs the *same* buffer under *that* NIC's keys.  A :class:`VMR` therefore
registers one buffer (an anonymous ``mmap``: page aligned, never moved by Python) on the
PD of every local NIC.  The peer learns all of them in the handshake as a
:class:`RemoteVMR`: per NIC address, ``(addr, rkey)``.  ``addr`` is the buffer's virtual
address, normally the same for every registration; offsets are kept per NIC anyway, so a
provider that hands out per-registration addresses works too.

Ownership: the endpoint owns its VMRs; ``close()`` deregisters every MR (idempotent).
Do not close a VMR that a posted READ still names (see the api cancellation contract):
:meth:`rdma.vrdma.vqp.VQP.read` returns only once its WR has completed.
"""
from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..api import SGE
from ..buffer import anonymous, copy_out
from ..enums import IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_REMOTE_READ
from ..errors import RdmaUserError

if TYPE_CHECKING:
    from ..api import MR, PD


@dataclass(frozen=True)
class RemoteVMR:
    """A peer's vMR: ``keys[nic_addr] = (addr, rkey)``; ``addr`` is its first NIC's
    address (the one callers use to name remote bytes)."""

    name: str
    length: int
    keys: dict[str, tuple[int, int]]

    @property
    def addr(self) -> int:
        return next(iter(self.keys.values()))[0]

    def on(self, nic: str, offset: int) -> tuple[int, int]:
        """``(remote_addr, rkey)`` of byte ``offset`` through remote NIC ``nic``."""
        addr, rkey = self.keys[nic]
        return addr + offset, rkey

    def to_dict(self) -> dict[str, Any]:
        return {"length": self.length,
                "keys": {nic: [a, k] for nic, (a, k) in self.keys.items()}}

    @classmethod
    def from_dict(cls, name: str, d: dict[str, Any]) -> RemoteVMR:
        keys = {str(nic): (int(v[0]), int(v[1])) for nic, v in d["keys"].items()}
        if not keys or int(d["length"]) < 0:
            raise ValueError(f"bad remote vMR {name!r}")
        return cls(name, int(d["length"]), keys)


class VMR:
    """``length`` bytes registered on each PD in ``pds`` (``{nic_addr: PD}``)."""

    def __init__(self, pds: dict[str, PD], length: int,
                 access: int = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ,
                 name: str = "", memory: mmap.mmap | None = None) -> None:
        if length <= 0:
            raise RdmaUserError(f"vMR length {length}: must be > 0")
        if memory is not None and len(memory) != length:
            raise RdmaUserError(f"vMR {name!r}: memory of {len(memory)} bytes for length {length}")
        self.name = name
        self.length = length
        self.access = access
        # private anonymous (huge pages when large), or the caller's mapping (a file that
        # outlives the process, as a node's arena does)
        self._map = memory if memory is not None else anonymous(length)
        self.view = memoryview(self._map)
        self.mrs: dict[str, MR] = {}
        self._closed = False
        try:
            for nic, pd in pds.items():
                self.mrs[nic] = pd.reg_mr(self._map, access)
        except BaseException:
            self.close()
            raise

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def memory(self) -> mmap.mmap:
        """The registered memory itself, for zero-copy consumers that must own a part of
        it beyond :meth:`close` (``ctypes.c_char.from_buffer``); ``view`` is for access."""
        return self._map

    @property
    def nics(self) -> list[str]:
        return list(self.mrs)

    def on(self, nic: str, offset: int) -> tuple[int, int]:
        """``(addr, lkey)`` of byte ``offset`` through local NIC ``nic`` (unchecked: the
        caller knows the range is inside; ``sge`` checks it), as ``RemoteVMR.on`` names
        a peer's byte: what the native fetch hands C (a READ's target, a landing slot's
        lkey on every NIC), where no SGE is built."""
        mr = self.mrs[nic]
        return mr.buf + offset, mr.lkey

    def sge(self, nic: str, offset: int, length: int) -> SGE:
        self._inside(offset, length)
        return self.mrs[nic].sge(offset, length)

    def _inside(self, offset: int, length: int) -> None:
        if offset < 0 or length < 0 or offset + length > self.length:
            raise RdmaUserError(f"[{offset}, {offset + length}) outside vMR of {self.length}")

    def remote(self, name: str | None = None) -> RemoteVMR:
        return RemoteVMR(name if name is not None else self.name, self.length,
                         {nic: (mr.buf, mr.rkey) for nic, mr in self.mrs.items()})

    def write(self, data: bytes | bytearray | memoryview, offset: int = 0) -> None:
        self.view[offset:offset + len(data)] = data

    def read(self, length: int, offset: int = 0) -> bytes:
        """A copy of ``length`` bytes from ``offset`` (``rdma.buffer.copy_out``: a large
        one without the GIL); RdmaUserError outside the vMR."""
        self._inside(offset, length)
        return copy_out(self._map, offset, length)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for mr in self.mrs.values():
            try:
                mr.close()
            except Exception:  # pragma: no cover - provider already gone
                pass
        self.mrs.clear()
        self.view.release()
        try:
            self._map.close()
        except BufferError:  # a provider still holds an export; the GC frees it later
            pass

    def __enter__(self) -> VMR:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
