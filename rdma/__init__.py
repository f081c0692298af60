"""kspeedfs RDMA: a verbs-shaped provider API (:mod:`rdma.api`) with two providers.

* ``soft``  (:mod:`rdma.providers.soft`): user-space RDMA over TCP with a native engine;
  serves one-sided READs without the application.  Used when there is no RDMA hardware.
* ``verbs`` (:mod:`rdma.providers.verbs`): rdma-core's pyverbs; imported only when selected.

Importing this package imports neither provider (and never pyverbs), nor :mod:`rdma.api`
until one of its names is used.  The public names are re-exported here; see
:mod:`rdma.api` for the contract.
"""
from .errors import (
    ConnectError,
    NoDeviceError,
    NotSupportedError,
    PostError,
    QPAttrError,
    QPStateError,
    RdmaError,
    RdmaUserError,
    ResourceBusyError,
    ResourceClosedError,
    WCError,
)

_API = ("AHAttr", "ConnInfo", "Context", "CQ", "Device", "DeviceAttr", "MR", "PD", "PortAttr",
        "QP", "QPAttr", "QPCap", "QPInitAttr", "RecvWR", "RemoteMR", "SGE", "SendWR", "WC",
        "find_device", "get_device_list", "open_device", "rc_connect_attr", "select_provider")


def __getattr__(name: str) -> object:
    """The :mod:`rdma.api` names, imported on first use: ``import rdma.errors`` (which
    every kspeedfs error builds on) then costs ~0.1 ms, not rdma.api's ~17 ms, and
    ``kspeedfs --help`` stays quick."""
    if name in _API:
        from . import api
        return getattr(api, name)
    raise AttributeError(f"module 'rdma' has no attribute {name!r}")


__all__ = [
    "AHAttr", "ConnInfo", "Context", "CQ", "Device", "DeviceAttr", "MR", "PD", "PortAttr",
    "QP", "QPAttr", "QPCap", "QPInitAttr", "RecvWR", "RemoteMR", "SGE", "SendWR", "WC",
    "find_device", "get_device_list", "open_device", "rc_connect_attr", "select_provider",
    "ConnectError", "NoDeviceError", "NotSupportedError", "PostError", "QPAttrError",
    "QPStateError", "RdmaError", "RdmaUserError", "ResourceBusyError",
    "ResourceClosedError", "WCError",
]
