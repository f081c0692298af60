"""Slot hints in the peer fetch (kspeedfs/cluster/fetch.py): a chunk READ a second time
goes straight to the slot it was found in; when the owner has since put another chunk
in that slot, the checksum says so and the bucket is READ as before — never wrong bytes.

Two real soft-provider endpoints on loopback: the "node" exports an arena and its index
as kspeedfs/cluster/node.py does; the reader calls ``Peers._read_from`` for one replica
(placement and membership are not under test here, so no etcd).
"""
from __future__ import annotations

import os

import trio
import xxhash

from kspeedfs.cluster.arena import Arena, Geometry
from kspeedfs.cluster.fetch import Peers
from kspeedfs.cluster.membership import NodeRecord
from rdma.vrdma import Endpoint

LO = "127.0.0.1"
SECRET = b"h" * 32
SLOT = 64 << 10


def _chunk(seed: int) -> tuple[bytes, bytes]:
    data = bytes([seed]) * 100 + os.urandom(SLOT - 100)
    return xxhash.xxh3_128_digest(data), data


async def test_a_stale_hint_falls_back_to_the_bucket_and_never_returns_wrong_bytes() -> None:
    geometry = Geometry.for_memory(2 * SLOT, SLOT)          # two slots: reuse comes fast
    async with Endpoint(SECRET, node="n1", addrs=[LO], provider="soft") as node, \
            Endpoint(SECRET, node="client", addrs=[LO], provider="soft") as client, \
            trio.open_nursery() as nursery:
        arena_mr = node.alloc(geometry.arena_bytes, name="arena", remote_read=True)
        index_mr = node.alloc(geometry.index_bytes, name="index", remote_read=True)
        node.export("arena", arena_mr)
        node.export("index", index_mr)
        arena = Arena(geometry, arena_mr, index_mr)
        port = await node.listen(LO)
        rec = NodeRecord("n1", "host1", [LO], port, 0, geometry.arena_bytes, geometry.nslots,
                         SLOT, geometry.nbuckets)
        peers = Peers(client, None, SECRET, replicas=1, slot_size=SLOT,  # type: ignore[arg-type]
                      nursery=nursery, nbuf=2)
        (ka, a), (kb, b), (kc, c) = _chunk(1), _chunk(2), _chunk(3)

        arena.put(ka, a)
        arena.put(kb, b)
        assert bytes(await peers._read_from(rec, ka, len(a))) == a       # bucket, then slot
        assert peers.counters.hinted == 0
        assert bytes(await peers._read_from(rec, ka, len(a))) == a       # the hint: one READ
        assert peers.counters.hinted == 1 and peers.counters.stale_hints == 0
        # a small file's extent of that chunk goes through the same hint
        part = (1000, 5000, xxhash.xxh3_128_digest(a[1000:6000]))
        assert bytes(await peers._read_from(rec, ka, len(a), part)) == a[1000:6000]
        assert peers.counters.hinted == 2
        # and so does a random read's block, verified against its xxh3-64
        block = (16 << 10, 16 << 10, xxhash.xxh3_64_digest(a[16 << 10:32 << 10]))
        assert bytes(await peers._read_from(rec, ka, len(a), block)) == a[16 << 10:32 << 10]

        arena.evict(ka)
        arena.put(kc, c)                                 # c now sits in a's old slot
        assert await peers._read_from(rec, ka, len(a)) is None          # gone, not c's bytes
        assert peers.counters.stale_hints == 1
        assert bytes(await peers._read_from(rec, kc, len(c))) == c
        assert bytes(await peers._read_from(rec, kb, len(b))) == b

        arena.evict(kb)
        arena.put(ka, a)                                 # back, in b's old slot
        assert bytes(await peers._read_from(rec, ka, len(a))) == a       # found by its bucket
        assert bytes(await peers._read_from(rec, kb, len(b)) or b"") == b""
        stats = peers.statistics()
        assert stats.peer_stale_hints == 2 and stats.peer_checksum_retries == 0
        wrong = (16 << 10, 16 << 10, xxhash.xxh3_64_digest(a[:16 << 10]))
        assert await peers._read_from(rec, ka, len(a), wrong) is None   # never unverified bytes
        await peers.aclose()
        await trio.sleep(0)
