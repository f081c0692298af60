"""``soft`` RDMA provider: user-space RDMA over TCP, one device per local IPv4 address.

It keeps verbs *semantics*, not just the API: a native engine thread (native/soft_engine.c)
serves one-sided READs from registered memory without the application, checks rkey, PD,
bounds and access (REM_ACCESS_ERR, never data outside an MR), turns a silent path into
RETRY_EXC_ERR after timeout × (retry_cnt + 1), flushes with WR_FLUSH_ERR on ERR, and
ACKs at once, as an RC NIC does (TCP_QUICKACK re-armed on every receive: Linux's delayed
ACKs held READ responses 30–60 ms; native/soft_engine.c, design notes).
Python only posts WRs and polls WCs.  One module per verbs object, as pyverbs:
``device`` (Context), ``pd``, ``mr``, ``cq``, ``qp``; ``engine`` owns the native thread and
``wire`` packs the HELLO.  CQs support moderation (``CQ.modify(cq_count, cq_period)``), as
perftest's ``--cq-mod`` uses it, to cut wake-ups per completion.  What is not
implemented: RDMA WRITE, atomics, immediate data, inline data, SRQ, UD/UC, SQD;
``post_send`` refuses those opcodes with PostError.
"""
from __future__ import annotations

from .device import SoftContext, get_device_list, open_device

__all__ = ["SoftContext", "get_device_list", "open_device"]
