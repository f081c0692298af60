"""The read path (reader.py) over real files, without the kernel: tiers, single-flight,
prefetch, bounded memory."""
from __future__ import annotations

import ctypes
import gc
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import trio
import xxhash

from kspeedfs.cache.disk import DiskCache
from kspeedfs.cache.memory import ALIGN_MIN, PAGE, MemoryCache, page_aligned
from kspeedfs.cache.prefetch import Stream
from kspeedfs.errors import SourceChanged, SourceError
from kspeedfs.manifest.importer import import_tree
from kspeedfs.manifest.index import ManifestIndex
from kspeedfs.manifest.store.embedded import EmbeddedStore
from kspeedfs.origin import Origin
from kspeedfs.reader import Reader, block_key

C = 64 << 10


@pytest.fixture
def dataset(tmp_path: Path):
    src = tmp_path / "src"
    src.mkdir()
    big = os.urandom(20 * C + 17)
    (src / "big").write_bytes(big)
    for i in range(30):
        (src / f"s{i:02d}").write_bytes(os.urandom(3000 + i))
    store = EmbeddedStore(tmp_path / "store")
    info = import_tree(src, "ds", store, C)
    ix = ManifestIndex.from_blob(store.manifest("ds", info.version))
    return src, ix, big


def _reader(ix, src, nursery, memory=8 << 20, disk=None, prefetch=4) -> Reader:
    return Reader(index=ix, origin=Origin(src, ix, "ds"), memory=MemoryCache(memory), disk=disk,
                  nursery=nursery, workers=4, prefetch_depth=prefetch)


def _recording_reader(ix, src, nursery, started: list[int]) -> Reader:
    """A reader with one worker thread whose origin appends each chunk it loads to
    ``started``, in the order the loads began."""

    class Recording(Origin):
        def load(self, chunk: int) -> tuple[memoryview, int]:
            started.append(chunk)
            return super().load(chunk)

    return Reader(index=ix, origin=Recording(src, ix, "ds"), memory=MemoryCache(8 << 20),
                  disk=None, nursery=nursery, workers=1, prefetch_depth=4)


async def test_concurrent_reads_share_one_load(dataset) -> None:
    src, ix, big = dataset
    entry = ix.lookup(0, b"big")
    async with trio.open_nursery() as n:
        r = _reader(ix, src, n, prefetch=0)
        out: dict[int, bytes] = {}

        async def one(i: int) -> None:
            out[i] = await r.read(entry, 100 * i, 1000)

        for i in range(20):
            n.start_soon(one, i)
    for i, data in out.items():
        assert data == big[100 * i:100 * i + 1000]
    s = r.statistics()
    assert s.source_loads == 1 and s.waited_in_flight + s.memory_hits == 19


async def test_sequential_reader_gets_prefetch(dataset) -> None:
    src, ix, big = dataset
    entry = ix.lookup(0, b"big")
    async with trio.open_nursery() as n:
        r = _reader(ix, src, n, prefetch=4)
        stream = Stream()
        got = bytearray()
        for off in range(0, len(big), 128 << 10):
            got += await r.read(entry, off, 128 << 10, stream)
        n.cancel_scope.cancel()
    assert bytes(got) == big
    s = r.statistics()
    assert s.prefetched >= 10
    assert s.source_loads == 21                      # every chunk loaded exactly once


async def test_a_readers_own_chunk_starts_loading_before_its_prefetches(dataset) -> None:
    """The chunks ahead are started after the chunk a read waits for: started first, they
    took the source's first GETs and the reader waited behind them (an object store's
    cold sequential read)."""
    src, ix, big = dataset
    entry = ix.lookup(0, b"big")
    started: list[int] = []
    async with trio.open_nursery() as n:
        r = _recording_reader(ix, src, n, started)
        stream = Stream()
        first = ix.chunk_range(entry, 0, 1)[0]
        await r.read(entry, 0, C, stream)            # chunk 0: not sequential yet
        await r.read(entry, C, C, stream)            # chunk 1, and 2..5 ahead
        n.cancel_scope.cancel()
    assert started[:2] == [first, first + 1], started


async def test_a_hinted_prefetch_starts_loading_after_the_read_that_sent_it(dataset) -> None:
    """The native engine's hint arrives beside the READ that made it: the READ's task is
    started, then the hint is handled at once. The READ's chunk still loads first."""
    src, ix, big = dataset
    entry = ix.lookup(0, b"big")
    started: list[int] = []
    async with trio.open_nursery() as n:
        r = _recording_reader(ix, src, n, started)
        first = ix.chunk_range(entry, 0, 1)[0]
        done = trio.Event()

        async def read() -> None:
            assert await r.read(entry, 0, C, Stream(next_offset=-1)) == big[:C]
            done.set()

        n.start_soon(read)                          # as EventPump.dispatch does
        for k in range(first + 1, first + 5):
            r.prefetch(entry, k)
        await done.wait()
        n.cancel_scope.cancel()
    assert started[0] == first, started


async def test_prefetch_of_all_streams_is_held_to_half_the_memory_tier(dataset) -> None:
    """Four sequential readers, a tier of 4 chunks, depth 4: without a shared budget
    their windows (16 chunks) evict one another's chunks unread, and those are loaded
    again when the reader gets there. (A tier this small is all transient LRU.)"""
    src, ix, big = dataset
    entry = ix.lookup(0, b"big")
    quarter = 5 * C
    async with trio.open_nursery() as n:
        r = _reader(ix, src, n, memory=4 * C, prefetch=4)
        streams = [Stream() for _ in range(4)]
        for step in range(0, quarter, 16 << 10):
            for i, stream in enumerate(streams):
                off = i * quarter + step
                assert await r.read(entry, off, 16 << 10, stream) == big[off:off + (16 << 10)]
                assert len(r.policy.ahead) <= r.ahead_max == 2
            await trio.sleep(0)
        n.cancel_scope.cancel()
    s = r.statistics()
    assert s.prefetch_skipped > 0
    assert s.source_loads <= 30, s                   # 20 chunks read: 22-25; no budget: 39


class _EngineMirror:
    """What the native engine's tier table tells the cache (``fuse.native.TierMirror``),
    with reads "served by C threads" marked by the test."""

    def __init__(self) -> None:
        self.held: set[bytes] = set()
        self.served_keys: set[bytes] = set()

    def put(self, key: bytes, data) -> None:
        self.held.add(key)
        self.served_keys.discard(key)

    def discard(self, key: bytes) -> None:
        self.held.discard(key)

    def touched(self, key: bytes) -> bool:
        return False

    def served(self, key: bytes) -> bool:
        return key in self.served_keys


async def test_prefetched_chunks_read_by_the_native_engine_free_the_budget(dataset) -> None:
    """With the native engine a prefetched chunk is read by C threads and never passes
    ``Reader.chunk``: once the engine has served it, it no longer counts against the
    prefetch budget (it did, held in the tier, and 79-98 % of a peer-reading mount's
    prefetches were skipped)."""
    src, ix, big = dataset
    entry = ix.lookup(0, b"big")
    mirror = _EngineMirror()
    async with trio.open_nursery() as n:
        r = _reader(ix, src, n, memory=8 * C, prefetch=4)
        r.memory.mirror_to(mirror)
        assert r.ahead_max == 4
        for k in range(20):                      # a C thread serves chunk k, hints k+1..k+4
            mirror.served_keys.add(ix.chunk_digest(k))
            for ahead in range(k + 1, min(k + 5, 21)):
                r.prefetch(entry, ahead)
            with trio.fail_after(5):
                while any(r.ahead.loading(ix.chunk_digest(a)) for a in range(k + 1, 21)):
                    await trio.sleep(0.001)
        n.cancel_scope.cancel()
    s = r.statistics()
    assert s.prefetched == 20 and s.prefetch_skipped == 0, s


async def test_memory_tier_is_bounded(dataset) -> None:
    src, ix, big = dataset
    entry = ix.lookup(0, b"big")
    async with trio.open_nursery() as n:
        r = _reader(ix, src, n, memory=4 * C, prefetch=0)
        for off in range(0, len(big), C):
            assert await r.read(entry, off, C) == big[off:off + C]
        assert r.memory.used <= 4 * C
        assert await r.read(entry, 0, 10) == big[:10]      # evicted, loaded again
    assert r.statistics().source_loads == 22


async def test_an_epoch_larger_than_the_tier_keeps_its_resident_part(dataset) -> None:
    """21 chunks through a tier of 4 (3 resident, 1 transient): a second pass finds the
    first 3 chunks; an LRU of 4 would have found none of them."""
    src, ix, big = dataset
    entry = ix.lookup(0, b"big")
    async with trio.open_nursery() as n:
        r = Reader(index=ix, origin=Origin(src, ix, "ds"), memory=MemoryCache(4 * C, transient_min=C),
                   nursery=n, workers=4, prefetch_depth=0)
        for _ in range(2):
            for off in range(0, len(big), C):
                assert await r.read(entry, off, C) == big[off:off + C]
        assert r.memory.used <= 4 * C
    s = r.statistics()
    assert s.source_loads == 21 + 18
    assert s.memory_resident_bytes == 3 * C < s.memory_bytes <= 4 * C


async def test_disk_tier_serves_after_memory_eviction(dataset, tmp_path: Path) -> None:
    src, ix, big = dataset
    entry = ix.lookup(0, b"big")
    disk = DiskCache(tmp_path / "disk", 64 << 20)
    async with trio.open_nursery() as n:
        r = _reader(ix, src, n, memory=2 * C, disk=disk, prefetch=0)
        for off in range(0, len(big), C):
            await r.read(entry, off, C)
        await trio.sleep(0.2)                               # disk writes are background tasks
        (src / "big").unlink()                              # the source is gone now
        assert await r.read(entry, 0, len(big)) == big
    assert r.statistics().disk_hits >= 18


async def test_changed_source_raises_with_the_file_name(dataset) -> None:
    src, ix, big = dataset
    with open(src / "s03", "r+b") as f:
        f.write(b"X")
    entry = ix.lookup(0, b"s03")
    async with trio.open_nursery() as n:
        r = _reader(ix, src, n)
        with pytest.raises(SourceChanged, match="s03.*re-import"):
            await r.read(entry, 0, 10)
        ok = ix.lookup(0, b"s04")
        assert await r.read(ok, 0, 3004) == (src / "s04").read_bytes()


def _resident(path: Path) -> int:
    out = subprocess.run(["fincore", "-b", "-n", "-o", "RES", str(path)], capture_output=True,
                         text=True, check=True).stdout
    return int(out.split()[0])


def test_source_pages_are_dropped_once_read(dataset) -> None:
    """A chunk read from the source leaves no copy in the page cache: the memory tier
    holds it now (a third copy next to the mount's own pages is what made cold reads
    crawl under memory pressure). Checked on the small files, each one extent: the
    kernel drops whole folios only, and this test's 64 KiB chunks of ``big`` lie inside
    the large folios its one big write made (kspeedfs's 4 MiB chunks cover them)."""
    src, ix, _ = dataset
    fs = subprocess.run(["stat", "-f", "-c", "%T", str(src)], capture_output=True, text=True).stdout
    if shutil.which("fincore") is None or fs.strip() == "tmpfs":
        pytest.skip("needs fincore and a source on a disk filesystem (tmpfs pages stay)")
    small = sorted(src.glob("s*"))
    os.sync()                                          # written pages are clean, still cached
    assert sum(_resident(p) for p in small) > 0
    origin = Origin(src, ix, "ds")
    for k in range(ix.chunks):
        origin.load(k)
    assert sum(_resident(p) for p in small) == 0


def test_missing_source_is_refused_up_front(dataset, tmp_path: Path) -> None:
    _, ix, _ = dataset
    with pytest.raises(SourceError, match="missing"):
        Origin(tmp_path / "nowhere", ix, "ds")


async def test_small_files_read_alone_when_the_dataset_outgrows_the_tiers(dataset) -> None:
    """Memory for 4 of the 22 chunks: loading a 3 KB file's whole chunk would be evicted
    before its neighbours are read, so each small file is read alone and verified."""
    src, ix, big = dataset
    names = [f"s{i:02d}" for i in range(30)]
    async with trio.open_nursery() as n:
        r = _reader(ix, src, n, memory=4 * C, prefetch=0)
        assert not r.policy.chunks_fit
        for name in reversed(names):
            assert await r.read(ix.lookup(0, name.encode()), 0, 1 << 20) == (src / name).read_bytes()
        s = r.statistics()
        assert s.source_extents == 30 and s.source_loads == 0
        assert s.source_bytes == sum((src / name).stat().st_size for name in names)
        assert await r.read(ix.lookup(0, b"s07"), 10, 20) == (src / "s07").read_bytes()[10:30]
        assert r.statistics().memory_hits == 1
        with open(src / "s03", "r+b") as f:             # changed after import: that file only
            f.write(b"X")
        r.memory.discard(next(ix.file_extents(ix.lookup(0, b"s03"))).digest)
        with pytest.raises(SourceChanged, match="s03.*re-import"):
            await r.read(ix.lookup(0, b"s03"), 0, 10)


async def test_whole_chunks_when_the_dataset_fits(dataset) -> None:
    src, ix, _ = dataset
    async with trio.open_nursery() as n:
        r = _reader(ix, src, n, prefetch=0)
        assert r.policy.chunks_fit
        for i in range(30):
            want = (src / f"s{i:02d}").read_bytes()
            assert await r.read(ix.lookup(0, f"s{i:02d}".encode()), 0, 1 << 20) == want
        s = r.statistics()
        assert s.source_extents == 0 and s.source_loads <= 3


@pytest.fixture
def blocked(tmp_path: Path):
    """A 1 MiB-chunk dataset with 16 KiB blocks: one big file and a few packed small ones."""
    src = tmp_path / "bsrc"
    src.mkdir()
    big = os.urandom(3 * (1 << 20) + 5000)
    (src / "big").write_bytes(big)
    for i in range(4):
        (src / f"t{i}").write_bytes(os.urandom(40_000 + i))
    store = EmbeddedStore(tmp_path / "bstore")
    info = import_tree(src, "ds", store, 1 << 20, block_size=16 << 10)
    ix = ManifestIndex.from_blob(store.manifest("ds", info.version))
    assert ix.block_size == 16 << 10
    return src, ix, big


async def test_random_reads_load_blocks_not_chunks(blocked) -> None:
    """A random 4 KiB read that misses loads its 16 KiB block, not its 1 MiB chunk; a
    read across a block boundary loads both blocks; a sequential reader still gets
    whole chunks (and prefetch). The tier (2 MiB) is smaller than the dataset, so no
    chunk is promoted to a whole load."""
    src, ix, big = blocked
    entry = ix.lookup(0, b"big")
    B = 16 << 10
    offsets = [5 * B + 100, 70 * B, 3 * (1 << 20) + 100, 9 * B - 2048, 5 * B + 3000]
    async with trio.open_nursery() as n:
        r = _reader(ix, src, n, memory=2 << 20, prefetch=2)
        assert not r.policy.chunks_fit
        stream = Stream(next_offset=-1)
        for off in offsets:
            assert await r.read(entry, off, 4096, stream) == big[off:off + 4096]
        s = r.statistics()
        touched = {(off // B, (off + 4095) // B) for off in offsets}
        blocks = {b for pair in touched for b in pair}
        assert s.source_loads == 0 and s.block_reads == len(offsets)
        assert s.source_blocks == len(blocks) == 5          # the last read hit a cached block
        assert s.source_bytes == 5 * B       # (big's tail shares its block with t0: full too)
        seq = Stream()
        got = bytearray()
        for off in range(0, 2 << 20, 128 << 10):
            got += await r.read(entry, off, 128 << 10, seq)
        assert bytes(got) == big[:2 << 20]
        assert r.statistics().source_loads >= 2 and r.statistics().block_reads == len(offsets)
        n.cancel_scope.cancel()


async def test_a_small_read_across_a_chunk_boundary_loads_two_blocks(blocked) -> None:
    """4 KiB across chunks 0 and 1, and a page-rounded 132 KiB read inside one chunk
    (Python's buffered open() with st_blksize = a 128 KiB block): blocks only."""
    src, ix, big = blocked
    entry = ix.lookup(0, b"big")
    B = ix.block_size
    async with trio.open_nursery() as n:
        r = _reader(ix, src, n, memory=2 << 20, prefetch=0)
        off = (1 << 20) - 2000
        assert await r.read(entry, off, 4096, Stream(next_offset=-1)) == big[off:off + 4096]
        assert (r.statistics().source_blocks, r.statistics().source_loads) == (2, 0)
        off = (2 << 20) + 3 * B + 4096
        size = B + 4096            # two blocks: the rest of block 3 and all of block 4
        assert await r.read(entry, off, size, Stream(next_offset=-1)) == big[off:off + size]
        assert (r.statistics().source_blocks, r.statistics().source_loads) == (4, 0)


async def test_a_large_random_read_loads_its_chunk(blocked) -> None:
    """A read over more than ``MAX_READ_BLOCKS`` blocks (five here; a shard reader's
    1 MiB requests) is one chunk load, not a block load per 16 KiB."""
    src, ix, big = blocked
    entry = ix.lookup(0, b"big")
    async with trio.open_nursery() as n:
        r = _reader(ix, src, n, memory=2 << 20, prefetch=0)
        off = (1 << 20) + 5000
        assert await r.read(entry, off, 64 << 10, Stream(next_offset=-1)) == big[off:off + (64 << 10)]
        s = r.statistics()
        assert (s.block_reads, s.source_blocks, s.source_loads) == (0, 0, 1)


async def test_a_second_miss_in_a_chunk_loads_it_whole_when_the_dataset_fits(blocked) -> None:
    src, ix, big = blocked
    entry = ix.lookup(0, b"big")
    B = 16 << 10
    async with trio.open_nursery() as n:
        r = _reader(ix, src, n, prefetch=0)
        assert r.policy.chunks_fit
        stream = Stream(next_offset=-1)
        for off in (5 * B, 40 * B, 70 * B):          # chunks 0, 0, 1
            assert await r.read(entry, off, 4096, stream) == big[off:off + 4096]
        s = r.statistics()
        assert (s.source_blocks, s.source_loads) == (2, 1)
        for off in (7 * B, 50 * B):                  # chunk 0 is held whole now
            assert await r.read(entry, off, 4096, stream) == big[off:off + 4096]
        s = r.statistics()
        assert (s.source_blocks, s.source_loads) == (2, 1)
        key0 = ix.chunk_digest(0)                    # and its block 5 went: one copy
        assert key0 in r.memory and block_key(key0, 5) not in r.memory
        assert block_key(ix.chunk_digest(1), 6) in r.memory


async def test_a_changed_block_falls_back_to_the_chunk_which_names_the_file(blocked) -> None:
    src, ix, big = blocked
    with open(src / "big", "r+b") as f:
        f.seek(40_000)
        f.write(b"changed")
    entry = ix.lookup(0, b"big")
    async with trio.open_nursery() as n:
        r = _reader(ix, src, n, prefetch=0)
        stream = Stream(next_offset=-1)
        with pytest.raises(SourceChanged, match="big.*re-import"):
            await r.read(entry, 40_000, 4096, stream)
        assert r.statistics().block_fallbacks == 1
        small = ix.lookup(0, b"t2")                        # other files are unaffected
        assert await r.read(small, 100, 4096, stream) == (src / "t2").read_bytes()[100:4196]


async def test_a_changed_block_in_a_two_block_read_raises_source_changed(blocked) -> None:
    """Not an ExceptionGroup from the concurrent block loads: the FUSE boundary maps
    SourceChanged to EIO and logs the file; a group would be an "unexpected error"."""
    src, ix, big = blocked
    B = ix.block_size
    with open(src / "big", "r+b") as f:
        f.seek(9 * B + 100)
        f.write(b"changed")
    entry = ix.lookup(0, b"big")
    async with trio.open_nursery() as n:
        r = _reader(ix, src, n, prefetch=0)
        with pytest.raises(SourceChanged, match="big.*re-import"):
            await r.read(entry, 9 * B - 2048, 4096, Stream(next_offset=-1))
        s = r.statistics()
        assert s.block_fallbacks == 1                         # block 9 did not verify


def test_block_digests_cover_every_chunk(blocked) -> None:
    src, ix, big = blocked
    origin = Origin(src, ix, "ds")
    for k in range(ix.chunks):
        chunk = bytes(origin.load(k)[0])
        nblocks = -(-ix.chunk_len[k] // ix.block_size)
        assert ix.block_count(k) == nblocks
        for b in range(nblocks):
            part = chunk[b * ix.block_size:(b + 1) * ix.block_size]
            assert ix.block_len(k, b) == len(part)
            assert ix.block_digest(k, b) == xxhash.xxh3_64_digest(part)
            assert bytes(origin.load_block(k, b)) == part


class _PyBuffer(ctypes.Structure):
    _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.py_object), ("len", ctypes.c_ssize_t),
                ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int),
                ("ndim", ctypes.c_int), ("format", ctypes.c_char_p),
                ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                ("suboffsets", ctypes.c_void_p), ("internal", ctypes.c_void_p)]


def _address(data) -> int:
    """Where the bytes of any buffer (a read-only view too) start: what a C reply sees."""
    view = _PyBuffer()
    ctypes.pythonapi.PyObject_GetBuffer(ctypes.py_object(data), ctypes.byref(view), 0)
    try:
        return view.buf
    finally:
        ctypes.pythonapi.PyBuffer_Release(ctypes.byref(view))


def test_tier_buffers_from_the_source_and_the_disk_start_on_a_page(tmp_path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    big = os.urandom(3 * (1 << 20) + 5000)
    (src / "big").write_bytes(big)
    for i in range(4):
        (src / f"t{i}").write_bytes(os.urandom(ALIGN_MIN + 5000 + i))
    store = EmbeddedStore(tmp_path / "store")
    info = import_tree(src, "ds", store, 1 << 20, block_size=ALIGN_MIN)
    ix = ManifestIndex.from_blob(store.manifest("ds", info.version))
    origin = Origin(src, ix, "ds")
    k = ix.chunks - 1                       # a chunk of packed small files, not 1 MiB long
    chunk, _ = origin.load(k)
    assert _address(chunk) % PAGE == 0 and bytes(chunk) == bytes(origin.load(k)[0])
    assert ix.block_size >= ALIGN_MIN
    block = origin.load_block(0, 1)
    assert block is not None and _address(block) % PAGE == 0
    assert bytes(block) == big[ix.block_size:2 * ix.block_size]
    small = next(e for e in ix.chunk_extents(k) if e.length >= ALIGN_MIN)
    extent = origin.load_extent(small)
    assert _address(extent) % PAGE == 0 and len(extent) == small.length
    disk = DiskCache(tmp_path / "disk", capacity=1 << 30)
    disk.put(b"k" * 16, bytes(chunk))
    again = disk.get(b"k" * 16)
    assert again is not None and _address(again) % PAGE == 0 and again == chunk
    # below ALIGN_MIN a buffer is a plain bytearray's: zeroed, writable, its length
    tiny = page_aligned(100)
    assert len(tiny) == 100 and not any(tiny) and not tiny.readonly
    for n in (ALIGN_MIN, (4 << 20) + 3):
        buf = page_aligned(n)
        assert len(buf) == n and _address(buf) % PAGE == 0 and not any(buf[:4096])


def test_chunk_sized_buffers_are_mappings_reused_or_unmapped_after_their_last_view(
        monkeypatch) -> None:
    from kspeedfs.cache import memory
    from kspeedfs.tuning import POPULATE_MIN

    def mapped(addr: int) -> bool:
        with open("/proc/self/maps") as f:
            spans = (line.split()[0].split("-") for line in f)
            return any(int(lo, 16) <= addr < int(hi, 16) for lo, hi in spans)

    n = POPULATE_MIN + 3
    buf = page_aligned(n)
    assert len(buf) == n and not buf.readonly and buf.format == "B"
    assert _address(buf) % PAGE == 0 and not any(buf)
    buf[-1] = 7
    ro = buf.toreadonly()[-4:]              # a view of a view keeps the mapping
    addr = _address(buf)
    del buf
    gc.collect()
    assert ro[-1] == 7 and page_aligned(n) is not None and _address(page_aligned(n)) != addr
    del ro
    gc.collect()                            # a spare now: the next buffer of its size, zeroed
    again = page_aligned(n)
    assert _address(again) == addr and not any(again)
    del again
    monkeypatch.setattr(memory, "SPARE_BYTES", 0)
    monkeypatch.setattr(memory, "_spare", {})
    monkeypatch.setattr(memory, "_spare_bytes", 0)
    buf = page_aligned(n)
    addr = _address(buf)
    del buf
    gc.collect()                            # no room for spares: unmapped
    assert not mapped(addr)
    # the kernel refusing a mapping (the map count spent): a bytearray's buffer instead
    monkeypatch.setattr(memory, "_populated", lambda n: None)
    buf = page_aligned(POPULATE_MIN)
    assert len(buf) == POPULATE_MIN and _address(buf) % PAGE == 0 and not any(buf)
