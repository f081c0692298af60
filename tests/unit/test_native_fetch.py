"""The native chunk fetch (kspeedfs/cluster/native/fetch.py) against a fake engine: what it
posts to C and when it refuses, what a FETCHED or LATE event does to the memory tier, the
landing and staging slots, the slot hint and the hedger, and how C-started fetches are
adopted.

``FakeEngine`` records the fuse_fetch.h calls NativeFetch makes and plays the NIC and the
fetch thread: ``land`` writes a READ's bytes where it was posted, ``fetched`` builds the
engine queue's FETCHED event, and ``Rig.deliver`` hands it on through the session's own
dispatch (``EventPump.dispatch``), so the event's field order is the one a mount
uses. The tier chain, memory tier, manifest, landing pool and hedger are real; peers,
vQPs and registered memory are fakes, with no network.
"""
from __future__ import annotations

import errno
import itertools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio
from trio.testing import wait_all_tasks_blocked

from kspeedfs.cache.memory import MemoryCache
from kspeedfs.cache.singleflight import SingleFlight
from kspeedfs.cache.tiers import TierChain
from kspeedfs.cluster.hedge import Hedger
from kspeedfs.cluster.landing import Landing
from kspeedfs.cluster.native import fetch as native_fetch
from kspeedfs.cluster.native import inflight as native_inflight
from kspeedfs.cluster.native.fetch import NativeFetch
from kspeedfs.manifest.importer import import_tree
from kspeedfs.manifest.index import ManifestIndex
from kspeedfs.manifest.model import Extent, block_key
from kspeedfs.manifest.store.embedded import EmbeddedStore
from kspeedfs.origin import Origin
from kspeedfs.tuning import C_SLOTS, NATIVE_FAILED_FOR
from rdma.enums import ibv_wc_status
from rdma.vrdma.vqp import NativeTarget

_fe = pytest.importorskip("kspeedfs.fuse._engine", reason="the native FUSE engine is not built")
if native_fetch.soft_capi() is None:
    pytest.skip("the soft engine's C API is not built", allow_module_level=True)

from kspeedfs.fuse.events import EventPump  # noqa: E402  (after the skips: it needs _engine)

C = 64 << 10
BLOCK = 16 << 10
A, B = "node-a", "node-b"
ARENA = 0x7000_0000                # a peer's arena through the fake path: raddr of byte 0
QPN = 17
NO_CHUNK = (1 << 64) - 1           # FE_NO_CHUNK: FETCHED's chunk for an extent's fetch
FETCH_SHORT = 64                   # FE_FETCH_SHORT (fuse_fetch.h; the module has no name for it)
WC_ERROR = ibv_wc_status.IBV_WC_RETRY_EXC_ERR

_addresses = itertools.count(1 << 32, 1 << 30)


# -- fakes: registered memory, vQPs, peers, the engine ----------------------------------


@dataclass(frozen=True)
class Rec:
    """A member's record as ``Peers.native_route`` names it."""

    node: str
    started: float = 1.0
    slot_size: int = C


class FakeVMR:
    """Registered memory: its bytes, and one address per byte (one lkey on every NIC)."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.memory = bytearray(length)
        self.addr = next(_addresses)

    def on(self, nic: str, offset: int) -> tuple[int, int]:
        return self.addr + offset, 7


class FakeEndpoint:
    nics = ["nic0"]

    def __init__(self) -> None:
        self.vmrs: list[FakeVMR] = []

    def alloc(self, length: int, name: str = "") -> FakeVMR:
        vmr = FakeVMR(length)
        self.vmrs.append(vmr)
        return vmr

    def write(self, laddr: int, data: bytes) -> None:
        """What a NIC does with a READ's bytes: ``data`` at local address ``laddr``."""
        for vmr in self.vmrs:
            if vmr.addr <= laddr < vmr.addr + vmr.length:
                at = laddr - vmr.addr
                vmr.memory[at:at + len(data)] = data
                return
        raise AssertionError(f"no registered memory at {laddr:#x}")


class FakeVQP:
    """One UP path on the soft provider while ``up``; ``done``: QPs proven alive."""

    def __init__(self) -> None:
        self.up = True
        self.raw = object()                 # its soft engine
        self.done: list[int] = []

    def native_target(self, vmr: FakeVMR, at: int, remote: str, roff: int,
                      length: int) -> NativeTarget | None:
        if not self.up:
            return None
        laddr, lkey = vmr.on("nic0", at)
        return NativeTarget(self.raw, QPN, laddr, lkey, ARENA + roff, 9)

    def native_paths(self, remote: str) -> list[tuple[Any, int, str, int, int]]:
        return [(self.raw, QPN, "nic0", ARENA, 9)] if self.up else []

    def native_done(self, qpn: int) -> None:
        self.done.append(qpn)


class FakePeers:
    """The parts of ``cluster.fetch.Peers`` the native fetch uses, with a real landing
    pool and hedger. ``routes``: chunk digest → its first replica's (record, slot, vQP);
    ``held``: what a hedge's ``read_chunk`` finds at another replica."""

    def __init__(self, ep: FakeEndpoint, hedge: Hedger | None) -> None:
        self.ep = ep
        self.slot_size = C
        self.hedge = hedge
        self.hedger = hedge if hedge is not None else Hedger()
        self.landing = Landing(ep, C, limit=48)      # (> 2 × C_SLOTS: C gets its share)
        buf = ep.alloc(4 * C)
        self.staging = [(buf, i * C) for i in range(4)]
        self.routes: dict[bytes, tuple[Rec, int, FakeVQP]] = {}
        self.held: dict[bytes, bytes] = {}
        self.reads: list[dict[str, object]] = []
        self.landed: list[tuple[str, int]] = []
        self.stale: list[tuple[str, float, bytes]] = []

    def native_route(self, key: bytes, length: int) -> tuple[Rec, int, FakeVQP] | None:
        return self.routes.get(key)

    def staging_nowait(self) -> tuple[FakeVMR, int] | None:
        return self.staging.pop() if self.staging else None

    def give_staging(self, slot: tuple[FakeVMR, int]) -> None:
        self.staging.append(slot)

    def landed_native(self, node: str, nbytes: int, reads: int = 1) -> None:
        """One (node, bytes) per READ (a tally's samples here all have one length)."""
        self.landed.extend([(node, nbytes // reads)] * reads)

    def stale_hint(self, node: str, started: float, key: bytes) -> None:
        self.stale.append((node, started, key))

    async def read_chunk(self, dataset: str, version: int, chunk: int, key: bytes, length: int,
                         *, ask_owner: bool = True, exclude: str | None = None,
                         part: tuple[int, int, bytes] | None = None,
                         budgeted: bool = False) -> bytes | None:
        self.reads.append({"chunk": chunk, "exclude": exclude, "budgeted": budgeted})
        return self.held.get(key)


#: one of fetch_tally's samples: (peer, path, len, took_ns, key, block); key and block None
#: for a part not kept, else its tier key and the buffer C put there with no owner
Sample = tuple[int, int, int, int, bytes | None, bytes | None]


@dataclass
class Post:
    """One READ NativeFetch posted to C."""

    call: str
    handle: int
    qpn: int
    cookie: int
    laddr: int
    raddr: int
    k: int = NO_CHUNK
    length: int = 0
    entry: int = -1
    block: int = -1
    want: bytes = b""
    read: tuple[Any, ...] | None = None


class FakeEngine:
    """``kspeedfs.fuse._engine.Engine``'s fetch API (native/fuse_fetch.h) as NativeFetch
    calls it: every post, route, peer and slot recorded; ``refuse``, an OSError the next
    posts raise; ``park``, what ``read_or_park`` answers. The test plays the NIC and the
    fetch thread with ``land`` and ``fetched``."""

    def __init__(self, ep: FakeEndpoint) -> None:
        self.ep = ep
        self.raws: list[object] = []                 # by handle: soft engines with a CQ
        self.posts: dict[int, Post] = {}             # by cookie
        self.refuse: OSError | None = None
        self.routes: dict[int, tuple[int, int]] = {}     # chunk → (peer, arena offset)
        self.peers: dict[int, list[tuple[Any, ...]]] = {}    # peer → its UP paths ([]: off)
        self.slots: dict[int, int] = {}              # C's landing slots: id → laddr
        self.buffers: dict[int, bytes] = {}          # cookie → an extent C copied out
        self.unparked: list[int] = []
        self.parked: list[tuple[int, tuple[Any, ...]]] = []
        self.park = True
        self.keep = True                             # fetch_keep's
        self.tally: list[Sample] = []                # fetch_tally's samples

    def fetch_keep(self, keep: bool) -> None:
        self.keep = keep

    def fetch_tally(self) -> list[Sample]:
        out, self.tally = self.tally, []
        return out

    def fetch_enable(self, capi: object) -> None:
        pass

    def fetch_engine(self, raw: object) -> int:
        self.raws.append(raw)
        return len(self.raws) - 1

    def fetch_post(self, handle: int, qpn: int, k: int, cookie: int, laddr: int, lkey: int,
                   raddr: int, rkey: int, length: int) -> None:
        self._post(Post("fetch_post", handle, qpn, cookie, laddr, raddr, k=k, length=length))

    def fetch_post_extent(self, handle: int, qpn: int, entry: int, cookie: int, laddr: int,
                          lkey: int, raddr: int, rkey: int,
                          read: tuple[Any, ...] | None = None) -> None:
        self._post(Post("fetch_post_extent", handle, qpn, cookie, laddr, raddr, entry=entry,
                        read=read))

    def fetch_post_block(self, handle: int, qpn: int, entry: int, k: int, block: int,
                         want: bytes, cookie: int, laddr: int, lkey: int, raddr: int, rkey: int,
                         read: tuple[Any, ...] | None = None) -> None:
        self._post(Post("fetch_post_block", handle, qpn, cookie, laddr, raddr, k=k,
                        entry=entry, block=block, want=want, read=read))

    def _post(self, post: Post) -> None:
        if self.refuse is not None:
            raise self.refuse
        self.posts[post.cookie] = post

    def fetch_landed(self, cookie: int) -> bytes | None:
        return self.buffers.pop(cookie, None)

    def fetch_unpark(self, cookie: int) -> int:
        self.unparked.append(cookie)
        return 1

    def read_or_park(self, entry: int, read: tuple[Any, ...]) -> bool:
        self.parked.append((entry, read))
        return self.park

    def fetch_route(self, k: int, peer: int, offset: int) -> None:
        self.routes[k] = (peer, offset)

    def fetch_unroute(self) -> None:
        self.routes.clear()
        self.peers.clear()

    def fetch_peer(self, peer: int, paths: list[tuple[Any, ...]], limit_ns: int,
                   part_limits: tuple[int, ...] = ()) -> None:
        self.peers[peer] = list(paths)

    def fetch_slot(self, sid: int, laddr: int, lkeys: list[int]) -> bool:
        self.slots[sid] = laddr
        return True

    def fetch_staging(self, laddr: int, size: int, lkeys: list[int]) -> bool:
        return True

    def fetch_stop(self, timeout_ms: int = 5000) -> int:
        return 0

    # -- the NIC and the fetch thread -------------------------------------------------

    def land(self, cookie: int, data: bytes) -> None:
        """The READ posted as ``cookie`` lands ``data``; a part's C verifies and copies
        into a buffer of its own (``fetch_landed``)."""
        post = self.posts[cookie]
        self.ep.write(post.laddr, data)
        if post.call != "fetch_post":
            self.buffers[cookie] = bytes(data)

    def fetched(self, cookie: int, status: int = 0, *, k: int | None = None, slot: int = 0,
                peer: int = -1, path: int = 0, since: float = 0.0) -> Any:
        """The queue's FETCHED, as take() gives it (its own named type). A C-started
        chunk's slot is given back with it, unless it is only LATE."""
        if k is None:
            k = self.posts[cookie].k
        if cookie & _fe.FETCH_OWN and not cookie & _fe.FETCH_PART and status != _fe.FETCH_LATE:
            self.slots.pop(slot)
        return _fe.Fetched((cookie, k, status, slot, peer, path, since))


# -- the dataset and the rig ------------------------------------------------------------


@dataclass
class Dataset:
    src: Path
    index: ManifestIndex
    chunks: dict[int, bytes]       # chunk → its bytes
    small: bytes                   # file "a", alone in part of chunk 0


@pytest.fixture
def dataset(tmp_path: Path) -> Dataset:
    src = tmp_path / "src"
    src.mkdir()
    files = {b"a": os.urandom(3000), b"b": os.urandom(5000), b"big": os.urandom(4 * C)}
    for name, blob in files.items():
        (src / name.decode()).write_bytes(blob)
    store = EmbeddedStore(tmp_path / "store")
    info = import_tree(src, "ds", store, C, block_size=BLOCK)
    ix = ManifestIndex.from_blob(store.manifest("ds", info.version))
    chunks: dict[int, bytearray] = {}
    for name, blob in files.items():
        for e in ix.file_extents(ix.lookup(0, name)):
            buf = chunks.setdefault(e.chunk, bytearray(ix.chunk_len[e.chunk]))
            buf[e.chunk_offset:e.chunk_offset + e.length] = blob[e.file_offset:e.file_offset + e.length]
    return Dataset(src, ix, {k: bytes(v) for k, v in chunks.items()}, files[b"a"])


class Rig:
    """A NativeFetch over the fakes, attached to a real TierChain; every chunk ``k``
    routed to node A's slot ``10 + k``."""

    def __init__(self, ds: Dataset, nursery: trio.Nursery, hedge: Hedger | None = None) -> None:
        self.ix = ix = ds.index
        self.ep = FakeEndpoint()
        self.engine = FakeEngine(self.ep)
        self.peers = FakePeers(self.ep, hedge)
        self.memory = MemoryCache(8 << 20)
        self.chain = TierChain(index=ix, origin=Origin(ds.src, ix, "ds"), memory=self.memory,
                               flights=SingleFlight(nursery), limiter=trio.CapacityLimiter(2),
                               peers=self.peers, dataset=("ds", 1))
        self.nf = NativeFetch(self.engine, self.peers, self.chain, self.memory, ix)
        self.chain.attach_native(self.nf)
        self.pump = EventPump(None, None)   # a FETCHED event needs no reader nor replies
        self.pump.fetch = self.nf
        self.recs = {A: Rec(A), B: Rec(B)}
        self.vqps = {A: FakeVQP(), B: FakeVQP()}
        for k in range(ix.chunks):
            self.route(k, A)

    def route(self, k: int, node: str) -> None:
        self.peers.routes[self.key(k)] = (self.recs[node], 10 + k, self.vqps[node])

    def key(self, k: int) -> bytes:
        return self.ix.chunk_digest(k)

    def extent(self, name: bytes) -> Extent:
        (ext,) = self.ix.file_extents(self.ix.lookup(0, name))
        return ext

    def post(self, cookie: int | None = None) -> Post:
        """The post of ``cookie``, or the only one."""
        if cookie is None:
            (cookie,) = self.engine.posts
        return self.engine.posts[cookie]

    def tier(self, key: bytes) -> bytes | None:
        """A copy of what the memory tier holds under ``key``."""
        data = self.memory.get(key)
        return None if data is None else bytes(data)

    def deliver(self, event: Any) -> None:
        """``event`` from the engine's queue, handed on as the session does."""
        self.pump.dispatch(None, event)


class MonotonicClock:
    """``time`` for the native fetch's records (native_inflight): NATIVE_FAILED_FOR counts in
    time.monotonic, not trio's clock."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def monotonic(monkeypatch: pytest.MonkeyPatch) -> MonotonicClock:
    clock = MonotonicClock()
    monkeypatch.setattr(native_inflight, "time", clock)
    return clock


def waiter(rig: Rig, key: bytes, nursery: trio.Nursery) -> list[bytes | None]:
    """A task in ``rig.nf.wait(key)``; the list gets what the memory tier holds once it
    returns."""
    woke: list[bytes | None] = []

    async def wait() -> None:
        await rig.nf.wait(key)
        woke.append(rig.tier(key))

    nursery.start_soon(wait)
    return woke


# -- posting ----------------------------------------------------------------------------


async def test_a_chunk_with_a_slot_hint_an_up_path_and_a_free_landing_slot_is_posted(
        dataset, nursery) -> None:
    rig = Rig(dataset, nursery)
    assert rig.nf.start(2, rig.key(2))
    p = rig.post()
    assert (p.call, p.k, p.length, p.qpn) == ("fetch_post", 2, C, QPN)
    assert p.raddr == ARENA + 12 * C                           # its replica's slot
    assert rig.engine.raws[p.handle] is rig.vqps[A].raw        # on that path's soft engine
    assert any(v.addr <= p.laddr < v.addr + v.length for v in rig.peers.landing.segments)
    assert rig.key(2) in rig.nf.inflight
    assert not rig.nf.start(2, rig.key(2))                     # once while in flight
    # the chunks after it are routed for C to start itself, with node A's path and slots
    assert rig.engine.routes == {3: (0, 13 * C), 4: (0, 14 * C)}
    assert rig.engine.peers == {0: [(p.handle, QPN, ARENA, 9, 0)]}
    assert len(rig.engine.slots) == C_SLOTS


async def test_a_chunk_is_refused_without_a_slot_hint_an_up_path_or_a_landing_slot(
        dataset, nursery) -> None:
    rig = Rig(dataset, nursery)
    landing = rig.peers.landing
    del rig.peers.routes[rig.key(1)]
    assert not rig.nf.start(1, rig.key(1))                     # no hint: read_chunk learns it
    rig.route(1, A)
    rig.vqps[A].up = False
    spare = landing.spare
    assert not rig.nf.start(1, rig.key(1))
    assert landing.spare == spare                              # the slot it took went back
    rig.vqps[A].up = True
    held = []
    while (slot := landing.take()) is not None:
        held.append(slot)
    assert not rig.nf.start(1, rig.key(1))                     # every landing slot held
    assert rig.engine.posts == {} and rig.nf.inflight == {}
    for slot in held:
        landing.give(slot)
    assert rig.nf.start(1, rig.key(1))


async def test_a_post_c_refuses_is_not_taken_unless_c_has_the_chunk_in_flight(
        dataset, nursery) -> None:
    rig = Rig(dataset, nursery)
    spare = rig.peers.landing.spare
    rig.engine.refuse = OSError(errno.EAGAIN, "FE_FETCH_MAX in flight")
    assert not rig.nf.start(1, rig.key(1))
    assert rig.peers.landing.spare == spare and rig.key(1) not in rig.nf.inflight
    rig.engine.refuse = OSError(errno.EALREADY, "in flight")  # C started it from a route
    assert rig.nf.start(1, rig.key(1))                        # its READs park there
    assert rig.peers.landing.spare == spare and rig.key(1) not in rig.nf.inflight


# -- FETCHED ----------------------------------------------------------------------------


async def test_a_verified_fetched_adopts_the_landing_slot_and_wakes_wait(dataset, nursery) -> None:
    rig = Rig(dataset, nursery)
    key = rig.key(3)
    assert rig.nf.start(3, key)
    woke = waiter(rig, key, nursery)
    await wait_all_tasks_blocked()
    assert woke == []
    p = rig.post()
    rig.engine.land(p.cookie, dataset.chunks[3])
    rig.deliver(rig.engine.fetched(p.cookie))
    await wait_all_tasks_blocked()
    assert woke == [dataset.chunks[3]]
    assert key not in rig.nf.inflight
    assert rig.peers.landing.kept == 1                         # the slot is the tier's buffer:
    rig.ep.write(p.laddr, b"!")                                # no copy was made
    assert rig.tier(key)[:1] == b"!"
    assert rig.vqps[A].done == [QPN] and rig.peers.landed == [(A, C)]
    assert rig.chain.counters.peer_hits == 1


async def test_tier_chain_chunk_waits_for_the_native_fetch_and_reads_what_landed(
        dataset, nursery) -> None:
    rig = Rig(dataset, nursery)
    got: list[object] = []

    async def read() -> None:
        got.append(await rig.chain.chunk(4))

    nursery.start_soon(read)
    await wait_all_tasks_blocked()
    p = rig.post()
    assert p.k == 4 and got == []
    rig.engine.land(p.cookie, dataset.chunks[4])
    rig.deliver(rig.engine.fetched(p.cookie))
    await wait_all_tasks_blocked()
    assert len(got) == 1 and bytes(got[0]) == dataset.chunks[4]
    assert rig.chain.counters.source_loads == 0 and rig.peers.reads == []


@pytest.mark.parametrize("status, slot_back, hint_dropped, path_alive", [
    (WC_ERROR, True, False, False),                   # the READ failed on its path
    (FETCH_SHORT, True, False, False),
    (_fe.FETCH_MISMATCH, True, True, True),            # the replica reused the slot
    (_fe.FETCH_STOPPED, False, False, False),          # a NIC may yet write the slot
], ids=["wc-error", "short", "mismatch", "stopped"])
async def test_a_failed_fetched_leaves_the_chunk_to_python(
        dataset, nursery, monotonic, status, slot_back, hint_dropped, path_alive) -> None:
    rig = Rig(dataset, nursery)
    key = rig.key(2)
    assert rig.nf.start(2, key)
    woke = waiter(rig, key, nursery)
    await wait_all_tasks_blocked()
    spare = rig.peers.landing.spare
    rig.deliver(rig.engine.fetched(rig.post().cookie, status))
    await wait_all_tasks_blocked()
    assert woke == [None] and key not in rig.nf.inflight       # over, and not in the tier
    assert rig.peers.landing.spare == spare + slot_back
    assert rig.peers.stale == ([(A, 1.0, key)] if hint_dropped else [])
    assert rig.vqps[A].done == ([QPN] if path_alive else [])
    # a READ of it is not handed to C for NATIVE_FAILED_FOR s: Python's path answers it
    assert rig.nf.failed_lately(key)
    assert not rig.chain.hand_chunks([2], 3, (5, 77, 0, 4096, 0, 0.0))
    monotonic.now += NATIVE_FAILED_FOR
    assert not rig.nf.failed_lately(key)
    assert rig.chain.hand_chunks([2], 3, (5, 77, 0, 4096, 0, 0.0))
    assert rig.engine.parked == [(3, (5, 77, 0, 4096, 0, 0.0))]


# -- small files' extents and blocks ------------------------------------------------------


async def test_an_extent_fetched_takes_the_engines_buffer_into_the_memory_tier(
        dataset, nursery) -> None:
    rig = Rig(dataset, nursery)
    ext = rig.extent(b"a")
    read = (5, 77, 0, 3000, 0, 0.0)
    assert rig.chain.start_extent(0, ext, read)
    p = rig.post()
    assert (p.call, p.entry, p.read) == ("fetch_post_extent", ext.entry, read)
    assert p.raddr == ARENA + 10 * C + ext.chunk_offset
    assert len(rig.peers.staging) == 3                         # READ into a staging slot
    assert rig.engine.routes[0] == (0, 10 * C)                 # C starts its chunk's others
    rig.engine.land(p.cookie, dataset.small)
    rig.deliver(rig.engine.fetched(p.cookie, k=NO_CHUNK))
    assert rig.tier(ext.digest) == dataset.small
    assert rig.engine.buffers == {}                            # taken (fetch_landed)
    assert len(rig.peers.staging) == 4 and ext.digest not in rig.nf.inflight
    assert rig.key(0) not in rig.memory                        # the extent, not its chunk


async def test_an_extent_whose_fetch_failed_keeps_its_read_out_of_c_for_failed_for(
        dataset, nursery, monotonic) -> None:
    rig = Rig(dataset, nursery)
    ext = rig.extent(b"a")
    assert rig.nf.start_extent(0, ext, (5, 77, 0, 3000, 0, 0.0))
    cookie = rig.post().cookie
    rig.deliver(rig.engine.fetched(cookie, WC_ERROR, k=NO_CHUNK))
    assert len(rig.peers.staging) == 4 and ext.digest not in rig.memory
    assert not rig.nf.start_extent(0, ext, (5, 78, 0, 3000, 0, 0.0))
    assert list(rig.engine.posts) == [cookie]
    monotonic.now += NATIVE_FAILED_FOR
    assert rig.nf.start_extent(0, ext, (5, 78, 0, 3000, 0, 0.0))


async def test_a_block_is_posted_at_its_offset_against_its_block_digest(dataset, nursery) -> None:
    rig = Rig(dataset, nursery)
    read = (5, 77, 2 * BLOCK, 4096, 1, 0.0)
    assert rig.nf.start_block(1, 2, b"block-key", 3, read)
    p = rig.post()
    assert (p.call, p.k, p.block, p.entry, p.read) == ("fetch_post_block", 1, 2, 3, read)
    assert p.want == rig.ix.block_digest(1, 2) and len(p.want) == 8
    assert p.raddr == ARENA + 11 * C + 2 * BLOCK
    assert rig.engine.routes == {}                             # a random READ routes nothing
    rig.engine.land(p.cookie, dataset.chunks[1][2 * BLOCK:3 * BLOCK])
    rig.deliver(rig.engine.fetched(p.cookie))
    assert rig.tier(b"block-key") == dataset.chunks[1][2 * BLOCK:3 * BLOCK]


# -- hedging ----------------------------------------------------------------------------


async def test_a_late_fetch_is_hedged_from_another_replica_and_its_reads_unparked(
        dataset, nursery, mock_clock) -> None:
    hedge = Hedger()                        # no history: each READ's deadline is the cap
    rig = Rig(dataset, nursery, hedge)
    nursery.start_soon(rig.nf.run, nursery)
    key = rig.key(2)
    rig.peers.held[key] = dataset.chunks[2]
    assert rig.nf.start(2, key)
    cookie = rig.post().cookie
    woke = waiter(rig, key, nursery)
    await wait_all_tasks_blocked()
    mock_clock.jump(hedge.cap * 0.9)
    await wait_all_tasks_blocked()
    assert rig.peers.reads == [] and woke == []                # not before its deadline
    mock_clock.jump(hedge.cap * 0.2)
    await wait_all_tasks_blocked()
    assert rig.peers.reads == [{"chunk": 2, "exclude": A, "budgeted": True}]
    assert rig.engine.unparked == [cookie]
    assert woke == [dataset.chunks[2]]
    assert (hedge.hedges, hedge.won) == (1, 1)
    # C's READ is still out (its slot the NIC's); back, it finds the chunk there
    assert key in rig.nf.inflight
    spare = rig.peers.landing.spare
    rig.deliver(rig.engine.fetched(cookie, _fe.FETCH_EXISTS))
    assert key not in rig.nf.inflight and rig.peers.landing.spare == spare + 1
    assert not rig.nf.failed_lately(key) and rig.peers.landing.kept == 0


async def test_past_the_hedge_budget_a_late_fetch_is_waited_for(dataset, nursery, mock_clock) -> None:
    hedge = Hedger(burst=C - 1)             # less than one chunk's READ
    rig = Rig(dataset, nursery, hedge)
    nursery.start_soon(rig.nf.run, nursery)
    rig.peers.held[rig.key(2)] = dataset.chunks[2]
    assert rig.nf.start(2, rig.key(2))
    woke = waiter(rig, rig.key(2), nursery)
    await wait_all_tasks_blocked()
    mock_clock.jump(hedge.cap * 2)
    await wait_all_tasks_blocked()
    assert rig.peers.reads == [] and hedge.refused == 1 and woke == []
    p = rig.post()
    rig.engine.land(p.cookie, dataset.chunks[2])
    rig.deliver(rig.engine.fetched(p.cookie))
    await wait_all_tasks_blocked()
    assert woke == [dataset.chunks[2]]


async def test_no_new_fetch_goes_through_c_to_a_node_with_a_fetch_past_its_deadline(
        dataset, nursery, mock_clock) -> None:
    hedge = Hedger()
    rig = Rig(dataset, nursery, hedge)
    nursery.start_soon(rig.nf.run, nursery)
    assert rig.nf.start(2, rig.key(2))
    late = rig.post().cookie
    await wait_all_tasks_blocked()
    mock_clock.jump(hedge.cap * 2)
    await wait_all_tasks_blocked()
    assert rig.peers.reads != []                               # hedged (no replica had it)
    assert not rig.nf.start(3, rig.key(3))                     # A: read_chunk takes it
    rig.route(3, B)
    assert rig.nf.start(3, rig.key(3))                         # another node's still goes
    assert rig.engine.peers[0] == []                           # told again (chunk 4): off in C
    rig.deliver(rig.engine.fetched(late))                      # A's READ is back
    assert rig.nf.start(4, rig.key(4))


async def test_a_late_fetch_python_posted_turns_its_node_off_in_c_at_once(
        dataset, nursery, mock_clock) -> None:
    hedge = Hedger()
    rig = Rig(dataset, nursery, hedge)
    nursery.start_soon(rig.nf.run, nursery)
    assert rig.nf.start(1, rig.key(1))                         # chunks 2-4 routed to A in C
    assert rig.engine.peers[0] != []
    await wait_all_tasks_blocked()
    mock_clock.jump(hedge.cap * 2)
    await wait_all_tasks_blocked()
    assert rig.key(1) in rig.nf.inflight and rig.peers.reads != []     # late, hedged
    assert rig.engine.peers[0] == []


# -- the fetches C starts itself ----------------------------------------------------------


async def test_a_c_started_chunk_is_adopted_from_its_fetched_event(dataset, nursery) -> None:
    rig = Rig(dataset, nursery)
    assert rig.nf.start(1, rig.key(1))                         # C gets routes and slots
    sid, laddr = next(iter(rig.engine.slots.items()))
    cookie = _fe.FETCH_OWN | 1
    rig.ep.write(laddr, dataset.chunks[2])                     # C started chunk 2 there
    rig.deliver(rig.engine.fetched(cookie, k=2, slot=sid, peer=0, path=0))
    assert rig.tier(rig.key(2)) == dataset.chunks[2]
    assert rig.peers.landing.kept == 1 and rig.peers.landed == [(A, C)]
    assert rig.vqps[A].done == [QPN]
    assert len(rig.engine.slots) == C_SLOTS and laddr not in rig.engine.slots.values()
    assert rig.key(2) not in rig.nf.inflight


async def test_a_late_c_started_chunk_becomes_a_record_and_is_hedged(
        dataset, nursery, mock_clock) -> None:
    rig = Rig(dataset, nursery, Hedger())
    nursery.start_soon(rig.nf.run, nursery)
    await wait_all_tasks_blocked()
    assert rig.nf.start(1, rig.key(1))
    assert rig.engine.peers[0] != []
    sid = next(iter(rig.engine.slots))
    cookie = _fe.FETCH_OWN | 2
    rig.peers.held[rig.key(2)] = dataset.chunks[2]
    rig.deliver(rig.engine.fetched(cookie, _fe.FETCH_LATE, k=2, slot=sid, peer=0, path=0))
    await wait_all_tasks_blocked()
    assert rig.key(2) in rig.nf.inflight                       # a record now
    assert rig.engine.peers[0] == []                           # A off in C while it is late
    assert rig.peers.reads == [{"chunk": 2, "exclude": A, "budgeted": True}]
    assert rig.engine.unparked == [cookie]
    assert rig.tier(rig.key(2)) == dataset.chunks[2]
    assert not rig.nf.start(3, rig.key(3))
    spare = rig.peers.landing.spare
    rig.deliver(rig.engine.fetched(cookie, _fe.FETCH_EXISTS, k=2, slot=sid, peer=0, path=0))
    assert rig.key(2) not in rig.nf.inflight
    assert rig.peers.landing.spare == spare                    # back, and fed to C again
    assert sid not in rig.engine.slots and len(rig.engine.slots) == C_SLOTS
    assert rig.nf.start(3, rig.key(3))                         # A is no longer late


async def test_a_c_started_extent_is_adopted_under_its_digest(dataset, nursery) -> None:
    rig = Rig(dataset, nursery)
    ext = rig.extent(b"a")
    assert rig.nf.start(1, rig.key(1))                         # peer 0 (A) told to C
    cookie = _fe.FETCH_OWN | _fe.FETCH_PART | 3
    rig.engine.buffers[cookie] = dataset.small                 # C verified and copied it
    rig.deliver(rig.engine.fetched(cookie, k=0, slot=ext.entry, peer=0, path=0))
    assert rig.tier(ext.digest) == dataset.small
    assert rig.engine.buffers == {} and len(rig.peers.staging) == 4
    assert rig.vqps[A].done == [QPN] and rig.peers.landed == [(A, len(dataset.small))]


async def test_extents_c_did_not_keep_count_and_sample_every_read(dataset, nursery) -> None:
    """Once the memory tier's resident part is full, C is told not to keep the extents
    it starts (fetch_keep); a tally's samples then count as peer hits, each READ's time
    goes to the hedger (not one per tally: its thresholds stay those of every READ), and
    each path they came by is seen alive once. With room again, C keeps them."""
    hedge = Hedger()
    rig = Rig(dataset, nursery, hedge)
    ext = rig.extent(b"a")
    assert rig.nf.start(1, rig.key(1))                         # peer 0 (A) told to C
    assert rig.engine.keep and rig.memory.resident_room == 0   # (an 8 MiB tier: all LRU)
    cookie = _fe.FETCH_OWN | _fe.FETCH_PART | 3
    rig.engine.buffers[cookie] = dataset.small
    rig.deliver(rig.engine.fetched(cookie, k=0, slot=ext.entry, peer=0, path=0))
    assert not rig.engine.keep                                 # the put found no room
    hits = rig.chain.counters.peer_hits
    n = len(dataset.small)
    rig.engine.tally = [(0, 0, n, 3_000_000, None, None), (0, 0, n, 5_000_000, None, None),
                        (0, 0, n, 7_000_000, None, None),
                        (9, 0, n, 1_000_000, None, None)]      # (peer 9: never told)
    rig.deliver(_fe.Fetched((0, 0, _fe.FETCH_TALLY, 0, -1, 0, 0.0)))
    assert rig.engine.tally == []
    assert rig.chain.counters.peer_hits == hits + 3
    assert rig.peers.landed[-3:] == [(A, n)] * 3
    assert rig.vqps[A].done == [QPN, QPN]                     # the adoption's, the tally's
    health = hedge.health(A)
    assert health.reads == 4                                 # the adoption's READ + 3
    assert sum(health.counts) == health.reads
    assert health.longest >= 0.007
    rig.memory.resident_capacity = rig.memory.resident_used + rig.nf.routes.part_size - 1
    rig.deliver(_fe.Fetched((0, 0, _fe.FETCH_TALLY, 0, -1, 0, 0.0)))
    assert not rig.engine.keep                                 # room, but not for the largest
    rig.memory.resident_capacity = rig.memory.capacity        # room again
    rig.deliver(_fe.Fetched((0, 0, _fe.FETCH_TALLY, 0, -1, 0, 0.0)))
    assert rig.engine.keep


def tally_event() -> Any:
    """An FE_FETCHED with FE_FETCH_TALLY's status, as take() gives it."""
    return _fe.Fetched((0, 0, _fe.FETCH_TALLY, 0, -1, 0, 0.0))


async def test_a_kept_extent_told_in_a_tally_is_in_the_memory_tier_and_counted_once(
        dataset, nursery) -> None:
    """A part C started, kept and told in a tally (no FETCHED of its own): its buffer is
    adopted into the memory tier under its key, counted as one peer hit of its bytes,
    its READ's time sampled once, its path seen alive; not counted as unkept."""
    hedge = Hedger()
    rig = Rig(dataset, nursery, hedge)
    ext = rig.extent(b"a")
    assert rig.nf.start(1, rig.key(1))                         # peer 0 (A) told to C
    hits, nbytes = rig.chain.counters.peer_hits, rig.chain.counters.peer_bytes
    n = len(dataset.small)
    rig.engine.tally = [(0, 0, n, 4_000_000, ext.digest, dataset.small)]
    rig.deliver(tally_event())
    assert rig.tier(ext.digest) == dataset.small
    assert len(rig.memory) == 1
    assert rig.chain.counters.peer_hits == hits + 1
    assert rig.chain.counters.peer_bytes == nbytes + n
    assert rig.peers.landed == [(A, n)]
    assert hedge.health(A).reads == 1
    assert rig.vqps[A].done == [QPN]
    rig.deliver(tally_event())                                 # an empty tally: nothing more
    assert rig.chain.counters.peer_hits == hits + 1 and len(rig.memory) == 1


async def test_a_kept_block_told_in_a_tally_is_in_the_memory_tier_under_its_block_key(
        dataset, nursery) -> None:
    rig = Rig(dataset, nursery)
    assert rig.nf.start(1, rig.key(1))
    k = rig.ix.chunks - 1
    key = block_key(rig.key(k), 0)
    data = dataset.chunks[k][:rig.ix.block_len(k, 0)]
    rig.engine.tally = [(0, 1, len(data), 2_000_000, key, data)]
    rig.deliver(tally_event())
    assert rig.tier(key) == data
    assert rig.peers.landed == [(A, len(data))]


async def test_a_tally_sample_of_an_unknown_peer_is_not_counted_but_its_buffer_is_adopted(
        dataset, nursery) -> None:
    """A peer number never told (or renumbered since): its samples count nothing and go
    to no hedger, but a kept one's verified buffer, which C's tier holds with no owner,
    still goes into the memory tier (dropped, it would be freed under the tier)."""
    hedge = Hedger()
    rig = Rig(dataset, nursery, hedge)
    ext = rig.extent(b"a")
    hits = rig.chain.counters.peer_hits
    n = len(dataset.small)
    rig.engine.tally = [(9, 0, n, 1_000_000, ext.digest, dataset.small),
                        (9, 1, n, 1_000_000, None, None)]
    rig.deliver(tally_event())
    assert rig.tier(ext.digest) == dataset.small
    assert rig.chain.counters.peer_hits == hits
    assert rig.peers.landed == [] and hedge.health(A).reads == 0
