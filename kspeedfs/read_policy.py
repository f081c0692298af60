"""What a read loads, apart from the I/O that loads it (``reader.py`` carries it out).

    read(entry, offset, size)
      small file (≤ chunk/8), its chunk not in    → the file alone: one extent
        memory, and the dataset outgrows the        (``small_file``)
        tiers
      random read (not continuing the last one)   → its blocks, 128 KiB each
        over ≤ MAX_READ_BLOCKS blocks, the chunk     (``blocks_for``; the reader adds
        not promoted, in no local tier, not          "in no local tier, not loading")
        loading
      anything else                               → whole chunks
      sequential reader                           → prefetch, if the budget has room
                                                    (``room_ahead``)

Plain bookkeeping: no trio, no I/O, so tests/unit/test_read_policy.py asks it without a mount.
Each rule names the docs/ heading that holds the measurements behind it.
"""
from __future__ import annotations

from collections.abc import Callable

from .cache.prefetch import Stream
from .tuning import MAX_READ_BLOCKS, PROMOTE_AFTER, PROMOTE_TRACKED, SMALL_FILE_DIVISOR


def is_random(stream: Stream | None) -> bool:
    """Whether a read (already recorded by ``Prefetcher.advise``) is random: it does not
    continue the previous read of its file handle."""
    return stream is not None and stream.run == 0


class ReadPolicy:
    """The read path's decisions for one mounted dataset version: which unit a read loads
    (a small file alone, blocks, or whole chunks) and how far prefetch may run ahead.

    It decides from the manifest's geometry and its own bookkeeping only; what the tiers
    hold (memory, disk, in flight) the caller knows and checks. Not thread-safe: the trio
    thread only.

    Attributes:
        chunk_size, block_size: the manifest's geometry (``block_size`` 0: no blocks).
        chunks_fit: whether whole-chunk loads pay off — the dataset fits the tiers
            (memory + disk), so a chunk read once serves every file packed in it.
        block_loads: chunk → blocks random reads have loaded of it (promotion), at most
            ``PROMOTE_TRACKED`` chunks, oldest dropped first.
        ahead: keys of prefetched chunks not read yet, all streams together.
    """

    def __init__(self, *, chunk_size: int, block_size: int, chunks: int, tier_bytes: int) -> None:
        self.chunk_size = chunk_size
        self.block_size = block_size
        # When the dataset fits in the tiers, a chunk read once serves every file packed
        # in it; when it does not, the chunk is evicted before its neighbours are read and
        # a 110 KB file costs a 4 MiB load (docs/design.md, "Whole chunks or single files")
        self.chunks_fit = chunks * chunk_size <= tier_bytes
        self.block_loads: dict[int, int] = {}
        self.ahead: set[bytes] = set()

    # -- small files -----------------------------------------------------------------------

    def small_file(self, size: int) -> bool:
        """Whether a file of ``size`` bytes is fetched alone rather than with its whole
        chunk (when that chunk is not in the memory tier: the caller checks): a small
        file, when the dataset is too big for whole-chunk loads to pay off. From peers as
        from the source: when the dataset fits, one chunk READ serves every file packed
        in it, and the Python around a READ costs more than the bytes. When it does not
        fit, the chunk is evicted before its neighbours are read, and reading the file
        alone fetches a fraction of the bytes (docs/design.md, "Whole chunks or single
        files")."""
        return not self.chunks_fit and size <= self.small_file_limit

    @property
    def small_file_limit(self) -> int:
        """The largest file ``small_file`` fetches alone; 0: none (the dataset fits)."""
        return 0 if self.chunks_fit else self.chunk_size // SMALL_FILE_DIVISOR

    # -- blocks or the chunk -----------------------------------------------------------------

    def blocks(self, lo: int, hi: int) -> range:
        """The blocks under bytes [lo, hi) of a chunk."""
        return range(lo // self.block_size, (hi - 1) // self.block_size + 1)

    def blocks_for(self, k: int, lo: int, hi: int) -> bool:
        """Whether a small random read of bytes [lo, hi) of chunk ``k`` may load blocks
        rather than the chunk: the read touches at most ``MAX_READ_BLOCKS`` blocks (a
        4 KiB read, or the st_blksize-sized reads of Python's buffered ``open()``), the
        manifest has blocks, and the chunk is not promoted. The caller loads blocks only
        if, besides, the chunk is in no local tier and not loading already (a sequential
        reader fetches it, or it is cheap to get whole). A larger request, like the 1 MiB
        ones the kernel sends for a shard reader's 1-8 MiB reads, loads the chunk: as 8
        block loads it ran far slower than as one chunk load.

        Promotion: when the dataset fits the tiers, a chunk that random reads have
        already loaded ``PROMOTE_AFTER`` block(s) of is loaded whole on its next miss.
        Blocks answer sparse reads fast, but they warm a cache slowly: a block load brings
        far fewer bytes per second than a chunk load. Sparse readers, and datasets larger
        than the tiers, keep blocks. (Both rules' figures: docs/design.md, "Whole chunks
        or blocks".)"""
        B = self.block_size
        if not 0 < B < self.chunk_size or (hi - 1) // B - lo // B >= MAX_READ_BLOCKS:
            return False
        return not (self.chunks_fit and self.block_loads.get(k, 0) >= PROMOTE_AFTER)

    def block_loaded(self, k: int) -> None:
        """Count a block of chunk ``k`` loaded for a random read (promotion)."""
        if len(self.block_loads) >= PROMOTE_TRACKED and k not in self.block_loads:
            del self.block_loads[next(iter(self.block_loads))]
        self.block_loads[k] = self.block_loads.get(k, 0) + 1

    def chunk_loaded(self, k: int) -> bool:
        """Chunk ``k`` is held whole now: forget its block count; returns whether random
        reads had loaded blocks of it (the caller drops them: the chunk serves them, and a
        resident block would hold room for good)."""
        return bool(self.block_loads.pop(k, 0))

    # -- the prefetch budget -----------------------------------------------------------------

    def ahead_max(self, room: int) -> int:
        """Chunks that may be prefetched and not read yet, given the bytes the memory tier
        can take without evicting them (its resident part's room plus its transient LRU):
        half of it. Many sequential readers' windows in a small tier would evict one
        another's chunks unread and fetch them again (docs/benchmarks.md, "Where the time
        goes, and what changed in this round": over-fetch with a small client cache)."""
        return max(1, room // 2 // self.chunk_size)

    def room_ahead(self, room: int, alive: Callable[[bytes], bool]) -> bool:
        """Whether one more chunk may be prefetched (``room`` as for ``ahead_max``): first
        forget the ones ``alive`` says were evicted unread (or failed), so they do not hold
        the budget."""
        limit = self.ahead_max(room)
        if len(self.ahead) >= limit:
            self.ahead = {key for key in self.ahead if alive(key)}
        return len(self.ahead) < limit
