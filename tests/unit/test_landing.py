"""Landing slots (kspeedfs/cluster/landing.py): a kept chunk owns its slot until the last
view of it is gone, then the slot is reused; the pool grows by segments up to its limit.

Real soft-provider registrations on loopback (no peer needed: the slots are only local).
"""
from __future__ import annotations

import gc

import trio

from kspeedfs.cluster import landing as landing_mod
from kspeedfs.cluster.landing import Landing
from rdma.vrdma import Endpoint

SLOT = 64 << 10


async def test_a_kept_chunk_owns_its_slot_until_its_last_view_is_gone() -> None:
    async with Endpoint(b"s" * 32, addrs=["127.0.0.1"], provider="soft") as ep:
        pool = Landing(ep, SLOT, limit=3)
        slot = pool.take()
        assert slot is not None and pool.slots == 3          # one segment, capped by the limit
        vmr, at = slot
        vmr.view[at:at + 5] = b"chunk"                       # as a READ would land it
        data = pool.keep(slot, 5)
        tail = data[1:]                                      # a slice keeps it too
        assert bytes(data) == b"chunk" and data.readonly
        held = {pool.take(), pool.take()}
        assert pool.take() is None and pool.exhausted == 1   # every slot held
        del data
        gc.collect()
        assert pool.take() is None                           # the slice still owns it
        assert bytes(tail) == b"hunk"
        del tail
        gc.collect()
        assert pool.take() == slot                           # back, and reused
        for s in held:
            pool.give(s)
        assert len(pool._free) == 2


async def test_segments_are_added_on_demand(monkeypatch) -> None:
    monkeypatch.setattr(landing_mod, "SEGMENT", 2)
    async with Endpoint(b"s" * 32, addrs=["127.0.0.1"], provider="soft") as ep:
        pool = Landing(ep, SLOT, limit=5)
        assert pool.slots == 0                               # nothing registered up front
        got = [pool.take() for _ in range(5)]
        assert None not in got and len(pool.segments) == 3 and pool.slots == 5
        assert pool.take() is None
        await trio.sleep(0)
