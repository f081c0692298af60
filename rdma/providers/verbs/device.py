"""Verbs devices: what ``ibv_get_device_list`` shows, addressed by their RoCE v2 GID.

A kspeedfs device is named by its NIC's IPv4 address (the vRDMA layer pairs NICs by
routing).  On RoCE that address lives in the port's GID table as an IPv4-mapped GID, one
entry per RoCE version; we take the **RoCE v2** one (routable, UDP port 4791) and call its
index the device's ``gid_index``.  The table comes from one ``ibv_query_gid_table``
(type, address and netdev of each valid entry; sysfs is the fallback).  A
device with no RoCE v2 IPv4 GID (InfiniBand, a NIC without an IPv4 address, RoCE v1
only) is still listed, with ``ipv4=None``; opening it works, connecting a QP does not
(``local_info`` raises NotSupportedError).

GID index 0 and the API's defaults: ``rc_connect_attr`` passes ``sgid_index=0``.  On RoCE
index 0 is the fe80:: link-local GID, which never reaches a peer on another subnet, so
this provider reads ``sgid_index=0`` as "this device's gid_index" (see ``qp.py``).
"""
from __future__ import annotations

import ipaddress
import logging
import os
import socket
import threading
from pathlib import Path
from typing import Any

from ...api import CQ, PD, Context, Device, DeviceAttr, PortAttr, gid_from_ipv4
from ...errors import NoDeviceError
from .errors import mapped

log = logging.getLogger(__name__)

PROVIDER = "verbs"
SYSFS = Path("/sys/class/infiniband")
ROCE_V2 = "RoCE v2"
IBV_GID_TYPE_ROCE_V2 = 2     # enum ibv_gid_type (IB = 0, RoCE v1 = 1)
RXE_VENDOR_ID = 0xFFFFFF     # drivers/infiniband/sw/rxe/rxe_param.h
_LINK_LAYER = {1: "InfiniBand", 2: "Ethernet"}


def _read(p: Path) -> str:
    try:
        return p.read_text().strip()
    except OSError:
        return ""


def normalize_gid(text: str) -> str:
    """IPv6 text as the API spells GIDs: compressed, IPv4-mapped as ``::ffff:a.b.c.d``."""
    ip = ipaddress.IPv6Address(text)
    return gid_from_ipv4(str(ip.ipv4_mapped)) if ip.ipv4_mapped else str(ip)


def roce_v2_gids(name: str, port: int = 1, raw_ctx: object = None
                 ) -> list[tuple[int, str, str]]:
    """``(index, ipv4, netdev)`` of every RoCE v2 GID of ``name`` that maps an IPv4.

    One ``ibv_query_gid_table`` on an opened context (``raw_ctx``, or one opened here);
    the sysfs table is the fallback (rxe's has 1024 entries: thousands of file reads,
    seconds in a TCG guest, so only valid entries are looked at)."""
    from pyverbs.pyverbs_error import PyverbsError

    try:
        if raw_ctx is None:
            import pyverbs.device as d

            with d.Context(name=name) as ctx:
                return _gid_table(ctx, port)
        return _gid_table(raw_ctx, port)
    except (PyverbsError, AttributeError, OSError):
        log.debug("ibv_query_gid_table on %s failed; reading sysfs", name, exc_info=True)
        return _sysfs_gids(name, port)


def _gid_table(ctx: Any, port: int) -> list[tuple[int, str, str]]:
    entries = ctx.query_gid_table(int(ctx.query_port(port).gid_tbl_len))
    out = []
    for e in sorted(entries, key=lambda e: e.gid_index):
        if int(e.port_num) != port or int(e.gid_type) != IBV_GID_TYPE_ROCE_V2:
            continue
        g = e.gid_str() if callable(e.gid_str) else e.gid_str     # a method in v44
        try:
            ip = ipaddress.IPv6Address(g.decode() if isinstance(g, bytes) else str(g))
        except ValueError:
            continue
        if ip.ipv4_mapped is not None:
            try:
                netdev = socket.if_indextoname(e.ndev_ifindex) if e.ndev_ifindex else ""
            except OSError:
                netdev = ""
            out.append((int(e.gid_index), str(ip.ipv4_mapped), netdev))
    return out


def _sysfs_gids(name: str, port: int) -> list[tuple[int, str, str]]:
    base = SYSFS / name / "ports" / str(port)
    out = []
    try:
        indices = sorted(int(i) for i in os.listdir(base / "gids"))
    except OSError:
        return []
    for i in indices:
        try:
            ip = ipaddress.IPv6Address(_read(base / "gids" / str(i)))
        except ValueError:
            continue
        if ip.ipv4_mapped is None or ip.ipv4_mapped.is_unspecified:
            continue
        if _read(base / "gid_attrs" / "types" / str(i)) != ROCE_V2:
            continue
        out.append((i, str(ip.ipv4_mapped), _read(base / "gid_attrs" / "ndevs" / str(i))))
    return out


def get_device_list() -> list[Device]:
    """One :class:`Device` per (device, RoCE v2 IPv4 GID); ``[]`` when there are none.

    A NIC with two IPv4 addresses gives two entries for one device (``rxe0``,
    ``rxe0_1``), like the soft provider's ``soft_eth1_1``."""
    try:
        import pyverbs.device as d
        from pyverbs.pyverbs_error import PyverbsError
    except ImportError:
        return []
    try:
        raw = d.get_device_list()
    except PyverbsError:          # no RDMA in this kernel / no uverbs: "no devices"
        return []
    devs: list[Device] = []
    for dev in raw:
        name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
        guid = _guid(name)
        gids = roce_v2_gids(name)
        if not gids:
            devs.append(Device(name=name, provider=PROVIDER, node_guid=guid))
        for k, (_idx, ipv4, netdev) in enumerate(gids):
            devs.append(Device(name=name if k == 0 else f"{name}_{k}", provider=PROVIDER,
                               ipv4=ipv4, netdev=netdev or None, node_guid=guid))
    return devs


def _guid(name: str) -> int:
    """Node GUID from sysfs (``5054:00ff:fe4b:0000``); 0 if unreadable."""
    try:
        return int(_read(SYSFS / name / "node_guid").replace(":", ""), 16)
    except ValueError:
        return 0


def _ibv_name(name: str) -> str:
    """``rxe0_1`` (second address of rxe0) → ``rxe0``; real names (``mlx5_0``) as is."""
    if (SYSFS / name).exists() or "_" not in name:
        return name
    return name.rsplit("_", 1)[0]


def open_device(dev: Device) -> VerbsContext:
    if dev.provider != PROVIDER:
        raise NoDeviceError(f"{dev.name} is not a verbs device")
    return VerbsContext(dev)


class VerbsContext(Context):
    """An opened verbs device.  Owns the completion poller thread of its CQs (cq.py)."""

    def __init__(self, device: Device) -> None:
        super().__init__(device)
        self.ibv_name = _ibv_name(device.name)
        import pyverbs.device as d

        with mapped(f"open {self.ibv_name}", NoDeviceError):
            self.raw = d.Context(name=self.ibv_name)
        self.gid_index: int | None = None
        self.refresh_gid()
        with mapped("ibv_query_device"):
            vendor = int(self.raw.query_device().vendor_id)
        #: Soft-RoCE (rxe): vendor id 0xFFFFFF; its retry_cnt=7 means "forever" (qp.py)
        self.is_rxe = vendor == RXE_VENDOR_ID or self.ibv_name.startswith("rxe")
        self._poller_lock = threading.Lock()
        self._poller: object | None = None

    def refresh_gid(self) -> int | None:
        """Look up this device's RoCE v2 GID index again (``gid_index``). Called at every
        connect: the kernel rebuilds a netdev's GIDs when its link goes down and up, and
        the index an IPv4 address gets then need not be the one it had (a rebuilt path
        that kept the old index never came up after a NIC flap in the rxe guests)."""
        want = self.device.ipv4
        self.gid_index = next((idx for idx, ipv4, _nd in roce_v2_gids(self.ibv_name, raw_ctx=self.raw)
                               if want is None or ipv4 == want), None)
        return self.gid_index

    @property
    def poller(self) -> object:
        from .cq import Poller

        with self._poller_lock:
            if self._poller is None:
                self._poller = Poller(self.ibv_name)
            return self._poller

    def _close_impl(self) -> None:
        if self._poller is not None:
            self._poller.stop()  # type: ignore[attr-defined]
        raw = getattr(self, "raw", None)
        if raw is not None:
            raw.close()

    def query_device(self) -> DeviceAttr:
        self._check_open()
        with mapped("ibv_query_device"):
            a = self.raw.query_device()
        fw = getattr(a, "fw_version", "")
        return DeviceAttr(max_qp=a.max_qp, max_qp_wr=a.max_qp_wr, max_sge=a.max_sge,
                          max_cqe=a.max_cqe, max_mr_size=a.max_mr_size,
                          max_qp_rd_atom=a.max_qp_rd_atom, phys_port_cnt=a.phys_port_cnt,
                          fw_ver=fw.decode(errors="replace") if isinstance(fw, bytes)
                          else str(fw), vendor_id=a.vendor_id)

    def query_port(self, port_num: int = 1) -> PortAttr:
        self._check_open()
        with mapped(f"ibv_query_port {port_num}"):
            p = self.raw.query_port(port_num)
        return PortAttr(state=int(p.state), max_mtu=int(p.max_mtu),
                        active_mtu=int(p.active_mtu), gid_tbl_len=int(p.gid_tbl_len),
                        lid=int(p.lid), link_layer=_LINK_LAYER.get(int(p.link_layer),
                                                                    str(p.link_layer)))

    def query_gid(self, port_num: int = 1, index: int = 0) -> str:
        """The real GID table entry ``index`` (not remapped; see the module docstring)."""
        self._check_open()
        with mapped(f"ibv_query_gid {port_num}/{index}"):
            g = self.raw.query_gid(port_num, index)
        return normalize_gid(str(g.gid if hasattr(g, "gid") else g))

    def alloc_pd(self) -> PD:
        from .pd import VerbsPD

        self._check_open()
        return VerbsPD(self)

    def create_cq(self, cqe: int = 256) -> CQ:
        from .cq import VerbsCQ

        self._check_open()
        return VerbsCQ(self, cqe)

