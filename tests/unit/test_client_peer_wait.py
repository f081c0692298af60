"""``FileReads`` and the library's native fetch (``client/reads.py`` ``_peered``): which
reads a reading thread asks C for, what it does with C's answer, and that anything but
verified bytes goes to the loop — with a fake index, loop and ``PeerWait``."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from kspeedfs.client.reads import FileReads

CHUNK = 1 << 20
SIZES = [100_000, 200_000, 3 << 20]     # small, larger than an eighth of a chunk, 3 chunks


class Index:
    chunk_size = CHUNK
    size = SIZES
    data = [0, CHUNK, 2 * CHUNK]      # (where each file starts: _resident asks)

    def chunk_range(self, entry: int, offset: int, size: int) -> list[int]:
        return [0] if entry < 2 else [1, 2, 3]

    def file_extents(self, entry: int) -> list[Any]:
        return [SimpleNamespace(entry=entry, chunk_offset=4096, length=SIZES[entry],
                                digest=bytes(16))]

    def chunk_digest(self, k: int) -> bytes:
        return bytes([k]) * 16


class PeerWait:
    def __init__(self, answer: bytes | None) -> None:
        self.answer, self.asked, self.routed = answer, [], []

    def read(self, k: int, ext: Any) -> bytes | None:
        self.asked.append((k, ext.entry))
        return self.answer

    def route(self, k: int) -> None:
        self.routed.append(k)


class Loop:
    host = None

    def __init__(self, pw: PeerWait | None) -> None:
        self.peer_wait = pw
        self.counted: list[tuple[int, int]] = []
        self.calls: list[tuple[Any, ...]] = []
        self.memory = SimpleNamespace(resident=lambda key: None)

    def check(self) -> None:
        pass

    def count(self, nbytes: int, hits: int, host_bytes: int = 0, peer_bytes: int = 0) -> None:
        self.counted.append((nbytes, peer_bytes))

    def call(self, afn: Any, *args: Any, path: Any = None) -> bytes:
        self.calls.append(args)
        return b"loop"


def reads(answer: bytes | None, pw: bool = True) -> tuple[FileReads, Loop]:
    loop = Loop(PeerWait(answer) if pw else None)
    return FileReads(Index(), loop), loop       # type: ignore[arg-type]


def test_a_small_file_read_in_c_is_counted_and_never_reaches_the_loop() -> None:
    data = bytes(range(256)) * 390 + bytes(160)
    fr, loop = reads(data)
    assert fr.read(0, 0, SIZES[0], "f") == data
    assert fr.read(0, 10, 60_000, "f") == data[10:60_010]          # at least half of it
    assert loop.calls == [] and loop.counted == [(SIZES[0], SIZES[0]), (60_000, SIZES[0])]
    assert loop.peer_wait.asked == [(0, 0), (0, 0)]                # type: ignore[union-attr]


def test_anything_but_bytes_from_c_goes_to_the_loop() -> None:
    fr, loop = reads(None)
    assert fr.read(0, 0, SIZES[0], "f") == b"loop"
    assert len(loop.calls) == 1 and loop.counted == []


def test_pieces_larger_files_and_no_fetch_never_ask_c() -> None:
    fr, loop = reads(b"x" * SIZES[0])
    fr.read(0, 0, 1000, "f")                # less than half: the loop keeps the extent
    fr.read(1, 0, SIZES[1], "f")            # over an eighth of a chunk
    fr.read(2, 0, 4096, "f")                # several chunks
    assert loop.peer_wait.asked == [] and len(loop.calls) == 3     # type: ignore[union-attr]
    fr, loop = reads(None, pw=False)
    assert fr.read(0, 0, SIZES[0], "f") == b"loop"
