"""Soft devices: one per local IPv4 address whose link is up (loopback included).

A device is named after its NIC: ``soft_lo``, ``soft_eth1`` (a second address on the same
NIC gets ``soft_eth1_1``).  Opening one starts an engine listening on that address, so the
device's traffic leaves through that NIC; that is what lets the vRDMA layer treat two
NICs as two independent paths.
"""
from __future__ import annotations

import ipaddress
import itertools
import logging

from ...api import CQ, PD, Context, Device, DeviceAttr, PortAttr, gid_from_ipv4
from ...enums import IBV_MTU_1024, IBV_MTU_4096, IBV_PORT_ACTIVE, IBV_PORT_DOWN
from ...errors import NoDeviceError, RdmaUserError
from .engine import Engine, EngineStats, native

log = logging.getLogger(__name__)

PROVIDER = "soft"
_IFF_UP = 0x1
_IFF_RUNNING = 0x40


def get_device_list() -> list[Device]:
    """Every IPv4 address on an interface that is up, as a soft device."""
    devs: list[Device] = []
    seen: dict[str, int] = {}
    for ifname, ipv4, flags in native().interfaces():
        if not flags & _IFF_UP:
            continue
        n = seen.get(ifname, 0)
        seen[ifname] = n + 1
        name = f"soft_{ifname}" if n == 0 else f"soft_{ifname}_{n}"
        devs.append(Device(name=name, provider=PROVIDER, ipv4=ipv4, netdev=ifname,
                           node_guid=_guid(ipv4)))
    return devs


def _guid(ipv4: str) -> int:
    """A stable node GUID from the address (02:00 locally administered prefix)."""
    return (0x0200 << 48) | int(ipaddress.IPv4Address(ipv4))


def open_device(dev: Device) -> SoftContext:
    if dev.provider != PROVIDER or not dev.ipv4:
        raise NoDeviceError(f"{dev.name} is not a soft device")
    return SoftContext(dev)


class SoftContext(Context):
    """An opened soft device: owns the engine (listener + native thread)."""

    def __init__(self, device: Device) -> None:
        super().__init__(device)
        assert device.ipv4 is not None
        self.ipv4: str = device.ipv4
        self.engine = Engine(device.ipv4)
        self._pd_handles = itertools.count(1)  # next() is atomic under the GIL

    def _close_impl(self) -> None:
        self.engine.close()

    def statistics(self) -> EngineStats:
        """What the engine has done so far (dropped connections, bytes, QPs)."""
        self._check_open()
        return self.engine.stats()

    def query_device(self) -> DeviceAttr:
        self._check_open()
        return DeviceAttr(max_qp=4096, max_qp_wr=native().MAX_WR, max_sge=native().MAX_SGE,
                          max_mr_size=native().MAX_MSG, fw_ver="kspeedfs-soft-1",
                          max_qp_rd_atom=16)

    def query_port(self, port_num: int = 1) -> PortAttr:
        self._check_open()
        if port_num != 1:
            raise RdmaUserError(f"soft devices have one port, not {port_num}")
        up = self._link_up()
        return PortAttr(state=IBV_PORT_ACTIVE if up else IBV_PORT_DOWN,
                        max_mtu=IBV_MTU_4096, active_mtu=IBV_MTU_1024, gid_tbl_len=1,
                        service_port=self.engine.port)

    def _link_up(self) -> bool:
        for ifname, ipv4, flags in native().interfaces():
            if ipv4 == self.ipv4 and ifname == self.device.netdev:
                return bool(flags & _IFF_UP) and (bool(flags & _IFF_RUNNING)
                                                  or ifname == "lo")
        return False

    def query_gid(self, port_num: int = 1, index: int = 0) -> str:
        self._check_open()
        if port_num != 1 or index != 0:
            raise RdmaUserError(f"soft devices have one GID (port 1 index 0), "
                                f"not port {port_num} index {index}")
        return gid_from_ipv4(self.ipv4)

    def alloc_pd(self) -> PD:
        from .pd import SoftPD

        self._check_open()
        return SoftPD(self, next(self._pd_handles))

    def create_cq(self, cqe: int = 256) -> CQ:
        from .cq import SoftCQ

        self._check_open()
        return SoftCQ(self, cqe)


