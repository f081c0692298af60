"""Cache tiers, single-flight and prefetch, without the kernel."""
from __future__ import annotations

import threading
from pathlib import Path

import trio
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kspeedfs.cache.disk import DiskCache
from kspeedfs.cache.memory import MemoryCache
from kspeedfs.cache.prefetch import Prefetcher, Stream
from kspeedfs.cache.singleflight import SingleFlight
from kspeedfs.errors import LoadCancelled


class MemoryModel(RuleBasedStateMachine):
    """The memory tier against a list-based model that is obviously right: items are
    resident while 75 bytes have room for them and then kept; the rest go to a 25-byte
    LRU (oldest first)."""

    def __init__(self) -> None:
        super().__init__()
        self.cache = MemoryCache(100, transient_fraction=0.25, transient_min=0)
        self.resident: dict[bytes, int] = {}
        self.lru: list[tuple[bytes, int]] = []

    def _drop(self, k: bytes) -> None:
        self.resident.pop(k, None)
        self.lru = [(mk, ms) for mk, ms in self.lru if mk != k]

    @rule(key=st.integers(0, 9), size=st.integers(1, 60))
    def put(self, key: int, size: int) -> None:
        k = bytes([key])
        self.cache.put(k, b"x" * size)
        self._drop(k)
        if sum(self.resident.values()) + size <= 75:
            self.resident[k] = size
        elif size <= 25:
            self.lru.append((k, size))
            while sum(s for _, s in self.lru) > 25:
                self.lru.pop(0)

    @rule(key=st.integers(0, 9))
    def get(self, key: int) -> None:
        k = bytes([key])
        got = self.cache.get(k)
        hit = [(mk, ms) for mk, ms in self.lru if mk == k]
        assert (got is None) == (k not in self.resident and not hit)
        if k in self.resident:
            assert got is not None and len(got) == self.resident[k]
        elif hit:
            assert got is not None and len(got) == hit[0][1]
            self.lru = [(mk, ms) for mk, ms in self.lru if mk != k] + hit

    @rule(key=st.integers(0, 9))
    def discard(self, key: int) -> None:
        self.cache.discard(bytes([key]))
        self._drop(bytes([key]))

    @invariant()
    def bounded(self) -> None:
        want = sum(self.resident.values()) + sum(s for _, s in self.lru)
        assert self.cache.used == want <= 100
        assert len(self.cache) == len(self.resident) + len(self.lru)


def test_a_small_tier_is_all_lru() -> None:
    cache = MemoryCache(10 << 20)
    assert cache.transient_capacity == 10 << 20 and cache.resident_capacity == 0


def test_an_epoch_larger_than_the_tier_keeps_its_first_part() -> None:
    """Cyclic re-reads of 10 items with room for 5: the resident part is hit every epoch
    (an LRU would evict each item just before it came round again)."""
    cache = MemoryCache(500, transient_min=0)
    hits = 0
    for epoch in range(3):
        for i in range(10):
            key = bytes([i])
            if cache.get(key) is not None:
                hits += epoch > 0
            else:
                cache.put(key, b"x" * 100)
    assert hits == 2 * 3          # 3 resident items (375 bytes of room), both later epochs


class _ServingMirror:
    """The native engine's tier bits as ``MemoryCache`` asks them
    (``fuse.native.TierMirror``): ``serve`` is a C thread answering a READ from a buffer."""

    def __init__(self) -> None:
        self.touched_keys: set[bytes] = set()
        self.served_keys: set[bytes] = set()

    def serve(self, key: bytes) -> None:
        self.touched_keys.add(key)
        self.served_keys.add(key)

    def put(self, key: bytes, data) -> None:
        self.touched_keys.discard(key)
        self.served_keys.discard(key)

    def discard(self, key: bytes) -> None:
        self.put(key, None)

    def touched(self, key: bytes) -> bool:      # since last asked
        was = key in self.touched_keys
        self.touched_keys.discard(key)
        return was

    def served(self, key: bytes) -> bool:       # since put
        return key in self.served_keys


def test_sequential_readers_served_by_c_find_their_prefetched_chunks() -> None:
    """Readers whose READs C threads answer (no LRU reordering), each with chunks
    prefetched ahead: eviction takes chunks already read, never a prefetched one before
    its reader reaches it. (It took those: a chunk being read, spared for that, went to
    the young end past the chunks prefetched after it.)"""
    readers, ahead, chunks = 4, 4, 40
    cache = MemoryCache(readers * (ahead + 3), transient_min=0, transient_fraction=1.0)
    mirror = _ServingMirror()
    cache.mirror_to(mirror)
    key = {(r, k): bytes([r, k]) for r in range(readers) for k in range(chunks)}
    for r in range(readers):
        for k in range(ahead):
            cache.put(key[r, k], b"x")
    for k in range(chunks - ahead):
        for r in range(readers):
            for _ in range(4):                  # a chunk's READs, answered in C
                assert key[r, k] in cache, (r, k)
                mirror.serve(key[r, k])
            cache.put(key[r, k + ahead], b"x")  # and the prefetch it hinted
    assert all(key[r, k] in cache for r in range(readers) for k in range(chunks - ahead, chunks))


TestMemoryModel = MemoryModel.TestCase


def test_disk_tier_lru_and_restart(tmp_path: Path) -> None:
    d = DiskCache(tmp_path / "c", capacity=3000)
    for i in range(5):
        d.put(bytes([i]) * 16, bytes([i]) * 1000)
    assert d.used == 3000
    assert d.get(bytes([0]) * 16) is None and d.get(bytes([4]) * 16) == b"\4" * 1000
    (tmp_path / "c" / "ab").mkdir(exist_ok=True)
    (tmp_path / "c" / "ab" / ".tmp-leftover").write_bytes(b"half")
    again = DiskCache(tmp_path / "c", capacity=2000)        # restart with less room
    assert again.used == 2000
    assert not (tmp_path / "c" / "ab" / ".tmp-leftover").exists()
    again.discard(bytes([4]) * 16)
    assert again.get(bytes([4]) * 16) is None


def test_disk_tier_counts_a_key_written_by_two_threads_at_once_once(tmp_path: Path) -> None:
    """Threads putting the same chunks race between the "already held" check and the
    write; the bytes are the same, so the tier's ``used`` is what its files hold."""
    d = DiskCache(tmp_path / "c", capacity=1 << 30)
    keys = [bytes([i]) * 16 for i in range(40)]
    barrier = threading.Barrier(6)

    def writer() -> None:
        barrier.wait()
        for k in keys:
            d.put(k, k * 4096)

    threads = [threading.Thread(target=writer) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert d.used == len(keys) * 16 * 4096


async def test_single_flight_one_load_many_waiters() -> None:
    loads = 0

    async def load(x: int) -> int:
        nonlocal loads
        loads += 1
        await trio.sleep(0.05)
        return x * 2

    results = []
    async with trio.open_nursery() as n:
        sf: SingleFlight[int] = SingleFlight(n)

        async def reader() -> None:
            results.append(await sf.run(b"k", load, 21))

        for _ in range(10):
            n.start_soon(reader)
    assert loads == 1
    assert sorted(results) == [(42, False)] + [(42, True)] * 9


async def test_single_flight_error_reaches_every_waiter_and_cancel_does_not_kill_load() -> None:
    async def boom() -> int:
        await trio.sleep(0.02)
        raise ValueError("source broke")

    errors = 0
    async with trio.open_nursery() as n:
        sf: SingleFlight[int] = SingleFlight(n)

        async def reader() -> None:
            nonlocal errors
            try:
                await sf.run(b"k", boom)
            except ValueError:
                errors += 1

        for _ in range(3):
            n.start_soon(reader)
    assert errors == 3

    done = trio.Event()

    async def slow() -> int:
        await trio.sleep(0.05)
        done.set()
        return 1

    async with trio.open_nursery() as n:
        sf = SingleFlight(n)
        with trio.move_on_after(0.01):
            await sf.run(b"s", slow)          # the reader gives up ...
        await done.wait()                     # ... the load others may wait for does not


async def test_single_flight_cancelled_load_is_an_error_for_its_waiters() -> None:
    """The flight's nursery closing under a load (shutdown): a waiter elsewhere gets
    LoadCancelled, not a None result it would take for the value."""
    async def forever() -> int:
        await trio.sleep_forever()
        return 0

    got: list[BaseException] = []
    async with trio.open_nursery() as outer:
        async with trio.open_nursery() as flights:
            sf: SingleFlight[int] = SingleFlight(flights)

            async def waiter() -> None:
                try:
                    await sf.run(b"k", forever)
                except LoadCancelled as e:
                    got.append(e)

            outer.start_soon(waiter)
            await trio.sleep(0.01)
            flights.cancel_scope.cancel()
    assert len(got) == 1


def test_prefetch_only_for_sequential_readers() -> None:
    p = Prefetcher(depth=3, trigger=2)
    s = Stream()
    assert not p.advise(s, 0, 100, range(0, 1), 50)            # from the start: run = 1
    assert p.advise(s, 100, 100, range(0, 1), 50) == range(1, 4)
    assert p.advise(s, 200, 100, range(0, 1), 50) == range(0)  # already requested
    assert p.advise(s, 300, 100, range(1, 2), 50) == range(4, 5)
    q = Stream()
    assert not p.advise(q, 500, 100, range(0, 1), 50)          # random start
    assert not p.advise(q, 50, 100, range(0, 1), 50)
    assert not p.advise(s, 10_000, 100, range(5, 6), 50)       # a jump resets the run
    r = Stream()
    for off in (0, 100, 200):
        got = p.advise(r, off, 100, range(49, 50), 50)
    assert got == range(0)                                     # nothing past the last chunk
