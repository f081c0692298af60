"""A node's local RDMA NICs: which devices an endpoint opens, and what one of them offers.

:func:`open_nics` picks the devices (by IPv4 address; by default every device of the
provider except loopback, or loopback if that is all there is) and opens each with its
context and PD; :func:`close_nics` releases them.  :meth:`LocalNIC.rd_atomic` is the READ
depth a path QP on that NIC negotiates, on both the requester (:mod:`.requester`) and the
responder (:mod:`.responder`) side.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from ..api import PD, Context, Device, get_device_list
from ..errors import RdmaError
from ..tuning import MAX_RD_ATOMIC

#: the endpoint's log lines keep the logger name they always had (operators filter on it)
log = logging.getLogger("rdma.vrdma.endpoint")


@dataclass
class LocalNIC:
    """One opened local RDMA device: its address, device, context and PD."""

    addr: str
    device: Device
    ctx: Context
    pd: PD

    def rd_atomic(self) -> int:
        """``max_rd_atomic`` for a path QP here: :data:`MAX_RD_ATOMIC`, capped by the
        device (1 if it cannot say)."""
        try:
            return max(1, min(MAX_RD_ATOMIC, self.ctx.query_device().max_qp_rd_atom))
        except Exception:
            return 1


def open_nics(provider: str | None, addrs: list[str] | None) -> dict[str, LocalNIC]:
    """Open the devices of ``provider`` at ``addrs`` (None: see the module docstring),
    address → :class:`LocalNIC`.  RdmaError (ENODEV) if an address has no device or
    there is none at all; whatever was opened by then is closed again."""
    devs = get_device_list(provider)
    want = addrs
    if want is None:
        want = [d.ipv4 for d in devs if d.ipv4 and not d.ipv4.startswith("127.")]
        if not want:
            want = [d.ipv4 for d in devs if d.ipv4]
    nics: dict[str, LocalNIC] = {}
    try:
        for addr in want:
            dev = next((d for d in devs if d.ipv4 == addr), None)
            if dev is None:
                raise RdmaError(f"no RDMA device for local address {addr} "
                                f"(devices: {[(d.name, d.ipv4) for d in devs]})", 19)
            ctx = dev.open()
            nics[addr] = LocalNIC(addr, dev, ctx, ctx.alloc_pd())
        if not nics:
            raise RdmaError("no RDMA devices with an IPv4 address", 19)
    except BaseException:
        close_nics(nics)
        raise
    return nics


def close_nics(nics: dict[str, LocalNIC]) -> None:
    """Close every NIC's context (never raises) and empty ``nics``."""
    for nic in nics.values():
        try:
            nic.ctx.close()
        except Exception:
            log.debug("close %s", nic.device.name, exc_info=True)
    nics.clear()
