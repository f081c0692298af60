"""Slot hints in the peer fetch (kspeedfs/cluster/fetch.py): a chunk READ a second time
goes straight to the slot it was found in; when the owner has since put another chunk
in that slot, the checksum says so and the bucket is READ as before — never wrong bytes.

Two real soft-provider endpoints on loopback: the "node" exports an arena and its index
as kspeedfs/cluster/node.py does; the reader calls ``ArenaRead.read_from`` for one replica
(placement and membership are not under test here, so no etcd).
"""
from __future__ import annotations

import gc
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace

import trio
import xxhash

from kspeedfs.cluster.arena import BUCKET_BYTES, SPILL, Arena, Geometry, buckets_of, find_in_bucket
from kspeedfs.cluster.fetch import Peers
from kspeedfs.cluster.membership import NodeRecord
from rdma.vrdma import Endpoint

LO = "127.0.0.1"
SECRET = b"h" * 32
SLOT = 64 << 10


def _chunk(seed: int) -> tuple[bytes, bytes]:
    data = bytes([seed]) * 100 + os.urandom(SLOT - 100)
    return xxhash.xxh3_128_digest(data), data


@asynccontextmanager
async def _node_and_reader(geometry: Geometry) -> AsyncIterator[tuple[Arena, NodeRecord, Peers]]:
    """A node's arena and index exported on loopback (as node.py does), its record, and
    a reader's Peers."""
    async with Endpoint(SECRET, node="n1", addrs=[LO], provider="soft") as node, \
            Endpoint(SECRET, node="client", addrs=[LO], provider="soft") as client, \
            trio.open_nursery() as nursery:
        arena_mr = node.alloc(geometry.arena_bytes, name="arena", remote_read=True)
        index_mr = node.alloc(geometry.index_bytes, name="index", remote_read=True)
        node.export("arena", arena_mr)
        node.export("index", index_mr)
        port = await node.listen(LO)
        rec = NodeRecord("n1", "host1", [LO], port, 0, geometry.arena_bytes, geometry.nslots,
                         SLOT, geometry.nbuckets)
        peers = Peers(client, None, SECRET, replicas=1, slot_size=SLOT,  # type: ignore[arg-type]
                      nursery=nursery, nbuf=2)
        yield Arena(geometry, arena_mr, index_mr), rec, peers


async def test_a_stale_hint_falls_back_to_the_bucket_and_never_returns_wrong_bytes() -> None:
    geometry = Geometry.for_memory(2 * SLOT, SLOT)          # two slots: reuse comes fast
    async with _node_and_reader(geometry) as (arena, rec, peers):
        read = peers.arena_read.read_from
        (ka, a), (kb, b), (kc, c) = _chunk(1), _chunk(2), _chunk(3)

        arena.put(ka, a)
        arena.put(kb, b)
        assert bytes(await read(rec, ka, len(a))) == a       # bucket, then slot
        assert peers.counters.hinted == 0
        assert bytes(await read(rec, ka, len(a))) == a       # the hint: one READ
        assert peers.counters.hinted == 1 and peers.counters.stale_hints == 0
        # a small file's extent of that chunk goes through the same hint
        part = (1000, 5000, xxhash.xxh3_128_digest(a[1000:6000]))
        assert bytes(await read(rec, ka, len(a), part)) == a[1000:6000]
        assert peers.counters.hinted == 2
        # and so does a random read's block, verified against its xxh3-64
        block = (16 << 10, 16 << 10, xxhash.xxh3_64_digest(a[16 << 10:32 << 10]))
        assert bytes(await read(rec, ka, len(a), block)) == a[16 << 10:32 << 10]

        arena.evict(ka)
        arena.put(kc, c)                                 # c now sits in a's old slot
        assert await read(rec, ka, len(a)) is None          # gone, not c's bytes
        assert peers.counters.stale_hints == 1
        assert bytes(await read(rec, kc, len(c))) == c
        assert bytes(await read(rec, kb, len(b))) == b

        arena.evict(kb)
        arena.put(ka, a)                                 # back, in b's old slot
        assert bytes(await read(rec, ka, len(a))) == a       # found by its bucket
        assert bytes(await read(rec, kb, len(b)) or b"") == b""
        stats = peers.statistics()
        assert stats.peer_stale_hints == 2 and stats.peer_checksum_retries == 0
        wrong = (16 << 10, 16 << 10, xxhash.xxh3_64_digest(a[:16 << 10]))
        assert await read(rec, ka, len(a), wrong) is None   # never unverified bytes
        await peers.aclose()
        await trio.sleep(0)


async def test_a_chunk_in_its_second_bucket_is_found_there() -> None:
    """Past SPILL keys in its first bucket a key goes to its second (arena.py); a reader
    with no hint READs the first, then the second, and gets the chunk."""
    geometry = Geometry(nslots=SPILL + 2, slot_size=SLOT, nbuckets=2)
    chunks = []
    while len(chunks) < SPILL + 1:                  # keys whose buckets are 0, then 1
        k, d = _chunk(len(chunks))
        if buckets_of(k, 2) == (0, 1):
            chunks.append((k, d))
    async with _node_and_reader(geometry) as (arena, rec, peers):
        read = peers.arena_read.read_from
        for k, d in chunks:
            assert arena.put(k, d)
        last, data = chunks[-1]
        second = arena.index.read(BUCKET_BYTES, BUCKET_BYTES)
        assert find_in_bucket(second, last) is not None          # it is in bucket 1
        assert bytes(await read(rec, last, len(data))) == data
        assert bytes(await read(rec, chunks[0][0], len(chunks[0][1]))) == chunks[0][1]
        assert peers.counters.hinted == 0
        # a record that says 0 buckets (no index) is a node without the chunk, not a crash
        no_index = replace(rec, started=rec.started + 1, nbuckets=0)
        assert await read(no_index, chunks[1][0], len(chunks[1][1])) is None
        await peers.aclose()
        await trio.sleep(0)


async def test_a_silent_replica_is_hedged_then_tried_last_and_its_attempt_cleans_up() -> None:
    """Hedging on real loopback endpoints: the first replica accepts TCP and
    never answers (its connect hangs until the 1 s connect timeout); reads are hedged to
    the second after the cap (50 ms here), the hedge's bytes win, two overruns make the
    silent node suspect (tried last: no third hedge), and the losers, cancelled by the
    winner, hold no read-in-progress token or staging slot although their connect is
    still hanging."""
    import socket
    from types import SimpleNamespace

    from kspeedfs.cluster.hedge import Hedger
    from tests.unit.test_rpc_hostile import SECRET as S
    from tests.unit.test_rpc_hostile import SLOT as SL
    from tests.unit.test_rpc_hostile import _chunk as chunk
    from tests.unit.test_rpc_hostile import _node

    with socket.socket() as silent:
        silent.bind((LO, 0))
        silent.listen(16)                           # never accepted: a hung peer
        port = silent.getsockname()[1]
        async with _node("good") as (_, arena, good), \
                Endpoint(S, node="mount", addrs=[LO], provider="soft") as mount, \
                trio.open_nursery() as nursery:
            slow = replace(good, node="slow", host="slow", port=port, rpc_port=port)
            members = SimpleNamespace(nodes={"slow": slow, "good": good},
                                      members=[slow.member(), good.member()])
            hedger = Hedger(cap=0.05)
            peers = Peers(mount, members, S, replicas=2, slot_size=SL,  # type: ignore[arg-type]
                          nursery=nursery, nbuf=2, local_node="slow", hedge=hedger)
            chunks = [chunk() for _ in range(3)]
            for key, data in chunks:
                arena.put(key, data)
            assert [r.node for r in peers.order(chunks[0][0])] == ["slow", "good"]
            for i, (key, data) in enumerate(chunks):
                t0 = trio.current_time()
                got = await peers.read_chunk("ds", 1, i, key, len(data))
                assert got is not None and bytes(got) == data
                assert trio.current_time() - t0 < 0.5          # not the 1 s connect timeout
            assert (hedger.hedges, hedger.won) == (2, 2)        # the third read: good first
            assert [r.node for r in peers.order(chunks[0][0])] == ["good", "slow"]
            stats = peers.statistics()
            assert stats.peer_hedges == 2 and stats.peer_latency["good"].won == 2
            assert stats.peer_latency["slow"].suspected and stats.peer_latency["slow"].hedged == 2
            await trio.sleep(0.05)    # the losers were cancelled: nothing is held now,
            assert peers.staging.reads.value == 2 and peers.staging.free.value == 3 * 2
            assert peers.connections.connecting("slow")           # while the connect goes on
            # the bytes a read returned are the only hold on their landing slot: no
            # reference cycle (race <-> attempts) keeps it until the cycle collector runs
            gc.disable()
            try:
                key, data = chunks[0]
                got = await peers.read_chunk("ds", 1, 0, key, len(data))
                free = peers.landing.statistics().free
                del got
                assert peers.landing.statistics().free == free + 1
            finally:
                gc.enable()
            await peers.aclose()
            nursery.cancel_scope.cancel()


async def test_a_node_back_as_a_new_incarnation_is_read_last_until_it_is_connected() -> None:
    """A node that restarted publishes a record with a new ``started``: the vQP kept is
    to the incarnation before. Its connect goes on in the background while reads go to
    the other replica, none waiting for it (readers joined that connect, unhedged, and
    waited as long as the starting node took to answer). Here the new incarnation's
    listener accepts nothing, so its connect hangs until its timeout."""
    import socket
    from types import SimpleNamespace

    from kspeedfs.cluster.hedge import Hedger
    from tests.unit.test_rpc_hostile import SECRET as S
    from tests.unit.test_rpc_hostile import SLOT as SL
    from tests.unit.test_rpc_hostile import _chunk as chunk
    from tests.unit.test_rpc_hostile import _node

    with socket.socket() as silent:
        silent.bind((LO, 0))
        silent.listen(16)                           # never accepted: a node starting up
        async with _node("back") as (_, back_arena, back), _node("good") as (_, arena, good), \
                Endpoint(S, node="mount", addrs=[LO], provider="soft") as mount, \
                trio.open_nursery() as nursery:
            members = SimpleNamespace(nodes={"back": back, "good": good},
                                      members=[back.member(), good.member()])
            peers = Peers(mount, members, S, replicas=2, slot_size=SL,  # type: ignore[arg-type]
                          nursery=nursery, nbuf=2, local_node="back", hedge=Hedger())
            key, data = chunk()
            back_arena.put(key, data)
            arena.put(key, data)
            got = await peers.read_chunk("ds", 1, 0, key, len(data), exclude="good")
            assert got is not None and peers.counters.per_peer["back"] == len(data)
            assert await peers.read_chunk("ds", 1, 0, key, len(data), exclude="back")
            waits = peers.statistics().peer_connect_waits      # (both connected once)
            again = replace(back, port=silent.getsockname()[1], started=back.started + 1)
            members.nodes = {**members.nodes, "back": again}
            assert [r.node for r in peers.order(key)] == ["back", "good"]    # placement
            for _ in range(3):
                with trio.fail_after(0.5):                  # not the 1 s connect timeout
                    got = await peers.read_chunk("ds", 1, 0, key, len(data))
                assert got is not None and bytes(got) == data
            assert peers.counters.per_peer["good"] == 4 * len(data)
            assert peers.statistics().peer_connect_waits == waits
            assert peers.connections.connecting("back")       # while its connect goes on
            assert peers.native_route(key, len(data)) is None or \
                peers.native_route(key, len(data))[0].node == "good"
            await peers.aclose()
            nursery.cancel_scope.cancel()


async def test_a_hedge_waits_for_no_token_or_staging_slot_that_hung_reads_hold() -> None:
    """A stopped peer's READs keep their read-in-progress tokens and staging slots until
    its timeout. A hedge must not wait for them, or the READs it is to overtake hold it
    back: the hedge of a C READ past its deadline (``read_chunk(budgeted=True)``) once
    waited 516 ms so, its readers with it (the sequential-readers tail test, sanitized
    build). Here every token and staging slot is held, as such READs hold them: a plain
    read waits; a budgeted one returns the chunk at once, one more staging slot made."""
    from types import SimpleNamespace

    from kspeedfs.cluster.hedge import Hedger
    from tests.unit.test_rpc_hostile import SECRET as S
    from tests.unit.test_rpc_hostile import SLOT as SL
    from tests.unit.test_rpc_hostile import _chunk as chunk
    from tests.unit.test_rpc_hostile import _node

    async with _node("good") as (_, arena, good), \
            Endpoint(S, node="mount", addrs=[LO], provider="soft") as mount, \
            trio.open_nursery() as nursery:
        members = SimpleNamespace(nodes={"good": good}, members=[good.member()])
        peers = Peers(mount, members, S, replicas=1, slot_size=SL,  # type: ignore[arg-type]
                      nursery=nursery, nbuf=2, hedge=Hedger())
        key, data = chunk()
        arena.put(key, data)
        staging = peers.staging.free.value
        for sem in (peers.staging.reads, peers.staging.free):     # all held, as hung READs
            while sem.value:
                sem.acquire_nowait()
        with trio.move_on_after(0.3) as waited:
            await peers.read_chunk("ds", 1, 0, key, len(data))
        assert waited.cancelled_caught                  # a plain read waits for a token
        with trio.fail_after(5):
            got = await peers.read_chunk("ds", 1, 0, key, len(data), budgeted=True)
        assert got is not None and bytes(got) == data
        del got
        assert peers.staging.reads.value == 0 and peers.staging.free.value == 1
        for _ in range(staging):                # the hung READs end: the pool is one larger
            peers.staging.free.release()
        assert peers.staging.free.value == staging + 1
        await peers.aclose()
        nursery.cancel_scope.cancel()


async def test_a_replica_order_follows_every_membership_change() -> None:
    """Replica orders are kept per key (a rendezvous hash over every member per read
    cost 37 µs with 128 members), but a new member list is seen by the next read."""
    from types import SimpleNamespace

    from kspeedfs.cluster.placement import reader_order

    recs = {f"n{i}": NodeRecord(f"n{i}", f"h{i}", [LO], 1, 0, SLOT, 1, SLOT, 1) for i in range(6)}
    members = SimpleNamespace(nodes=recs, members=[r.member() for r in recs.values()])
    keys = [os.urandom(16) for _ in range(64)]
    async with Endpoint(SECRET, node="client", addrs=[LO], provider="soft") as client, \
            trio.open_nursery() as nursery:
        peers = Peers(client, members, SECRET, replicas=2, slot_size=SLOT,  # type: ignore[arg-type]
                      nursery=nursery, nbuf=1)
        for _ in range(2):                                   # computed, then kept
            assert [[r.node for r in peers.order(k)] for k in keys] == \
                [reader_order(k, members.members, 2, None) for k in keys]
        gone = {n for k in keys for n in reader_order(k, members.members, 2, None)[:1]}
        members.members = [m for m in members.members if m.node not in gone]   # replaced
        for k in keys:
            got = [r.node for r in peers.order(k)]
            assert got == reader_order(k, members.members, 2, None) and not set(got) & gone
        await peers.aclose()
        nursery.cancel_scope.cancel()


async def test_a_mount_finds_its_hosts_node_when_it_joins_after_the_mount() -> None:
    """``find_local``: the node with one of the mount's NICs is tried first from the first
    member list that has it, also when it was not there at the start (a mount made before
    its host's node registered, or resumed while etcd was down: found once at the start,
    it never was)."""
    from types import SimpleNamespace

    from kspeedfs.cluster.placement import reader_order

    far = {f"n{i}": NodeRecord(f"n{i}", f"h{i}", ["198.18.0.9"], 1, 0, SLOT, 1, SLOT, 1)
           for i in range(4)}
    members = SimpleNamespace(nodes=dict(far), members=[r.member() for r in far.values()])
    keys = [os.urandom(16) for _ in range(32)]
    async with Endpoint(SECRET, node="client", addrs=[LO], provider="soft") as client, \
            trio.open_nursery() as nursery:
        peers = Peers(client, members, SECRET, replicas=2, slot_size=SLOT,  # type: ignore[arg-type]
                      nursery=nursery, nbuf=1, find_local=True)
        assert peers.order(keys[0]) and peers.replicas.local_node is None    # (none of its NICs)
        near = NodeRecord("near", "here", [LO], 1, 0, SLOT, 1, SLOT, 1)
        members.nodes = {**far, "near": near}                       # the host's node joins
        members.members = [r.member() for r in members.nodes.values()]
        assert peers.local_member() == "near"
        for k in keys:
            assert [r.node for r in peers.order(k)] == \
                reader_order(k, members.members, 2, "near")
        held = [k for k in keys if "near" in [r.node for r in peers.order(k)]]
        assert held and all(peers.order(k)[0].node == "near" for k in held)   # tried first
        await peers.aclose()
        nursery.cancel_scope.cancel()
