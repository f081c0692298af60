"""``verbs`` RDMA provider: the :mod:`rdma.api` contract over rdma-core's pyverbs
(Debian python3-pyverbs 44), for real RDMA devices: RoCE v2 NICs and Soft-RoCE (rxe).

Imported only when selected (:func:`rdma.api.load_provider`); importing it imports
pyverbs.  One module per verbs object, as pyverbs and the soft provider:
``device`` (Context, device list, GID selection), ``pd``, ``mr``, ``cq`` (WC polling
without blocking trio), ``qp`` (the state table → ``ibv_modify_qp``).  See
``docs/verbs.md`` for the timeout arithmetic and what this provider cannot do.

* No devices (no RDMA in the kernel, no uverbs): ``get_device_list()`` returns ``[]``
  (pyverbs raises ``PyverbsRDMAError('Failed to get devices list')`` there).
* Addressing is RoCE v2 only: each device is identified by the IPv4 of its netdev, and
  its QPs use the RoCE v2 GID that holds that IPv4 (``::ffff:a.b.c.d``).
* No ``private_data`` channel (``remote_private_data`` is None); no ``timeout_ms``
  (only the IB ``timeout`` exponent exists in hardware).
"""
from __future__ import annotations

from .device import VerbsContext, get_device_list, open_device

__all__ = ["VerbsContext", "get_device_list", "open_device"]
