"""⑥ Checksums: every byte handed to a reader was verified against the manifest.

Where verification happens (the trust boundaries):

- bytes read from the **source** are checked extent by extent (``extents_match``),
  so a mismatch names the file that changed since import;
- bytes read from the **disk tier** (and, in the cluster, from a **peer**) are
  checked against the chunk digest in one pass (``chunk_matches``);
- a **block** (the unit of a random read, manifest/model.py) is checked against its
  xxh3-64 wherever it came from (``matches`` picks the hash by the digest's length);
- the **memory tier** holds only bytes that passed one of the above and are never
  written again (immutable ``bytes``), so a memory hit is served as is.

xxh3-128 runs at ~8 GB/s per core here and releases the GIL on large buffers, so
checking a 4 MiB chunk costs ~0.5 ms of one core without stalling the FUSE loop
when it runs in a worker thread.
"""
from __future__ import annotations

from collections.abc import Iterable

import xxhash

from .manifest.model import Extent


def digest(data: bytes | bytearray | memoryview) -> bytes:
    return xxhash.xxh3_128_digest(data)


def chunk_matches(data: bytes | bytearray | memoryview, expected: bytes) -> bool:
    return xxhash.xxh3_128_digest(data) == expected


def matches(data: bytes | bytearray | memoryview, expected: bytes) -> bool:
    """Whether ``data`` has digest ``expected``: xxh3-128 (a chunk or extent, 16 bytes)
    or xxh3-64 (a block, 8 bytes)."""
    if len(expected) == 8:
        return xxhash.xxh3_64_digest(data) == expected
    return xxhash.xxh3_128_digest(data) == expected


def first_bad_extent(chunk: bytes | bytearray | memoryview, extents: Iterable[Extent]) -> Extent | None:
    """The first extent whose bytes inside ``chunk`` do not match, or None if all match."""
    view = memoryview(chunk)
    for e in extents:
        if xxhash.xxh3_128_digest(view[e.chunk_offset:e.chunk_offset + e.length]) != e.digest:
            return e
    return None
