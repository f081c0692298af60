"""rdma/buffer.py: MR memory, and copies out of it (``copy_out``)."""
from __future__ import annotations

import mmap
import os
import threading
import time
from pathlib import Path

import pytest

from rdma.buffer import COPY_OUT_NOGIL, anonymous, copy_out


@pytest.mark.parametrize("offset,length", [(0, 1), (7, 4096), (3, COPY_OUT_NOGIL - 1),
                                           (0, COPY_OUT_NOGIL), (12345, 300_000),
                                           ((1 << 20) - COPY_OUT_NOGIL, COPY_OUT_NOGIL)])
def test_copy_out_returns_the_bytes_of_the_range(offset: int, length: int) -> None:
    buf = anonymous(1 << 20)
    buf[:] = os.urandom(1 << 20)
    out = copy_out(buf, offset, length)
    assert type(out) is bytes and out == buf[offset:offset + length]
    buf.close()                 # no export of the mapping is left behind


def test_copy_out_of_a_read_only_mapping_copies_it_holding_the_gil(tmp_path: Path) -> None:
    f = tmp_path / "segment"
    f.write_bytes(os.urandom(1 << 20))
    with open(f, "rb") as fh, mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ) as m:
        assert copy_out(m, 100, 200_000) == m[100:200_100]


def test_a_large_copy_out_lets_other_threads_run_python_meanwhile() -> None:
    """Fresh pages are faulted in by the copy itself: holding the GIL through it stalled
    the process's other threads (docs/design.md, "Copies out of a staging slot"). A
    spinning thread notes the time every 1,000 turns; some of its notes must fall in
    the middle half of a copy's duration (the edges: the GIL may change hands there)."""
    size = 256 << 20
    buf = anonymous(size)
    buf[:] = b"\x5a" * size
    notes: list[float] = []
    stop = threading.Event()

    def spin() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            if n % 1000 == 0:
                notes.append(time.perf_counter())

    t = threading.Thread(target=spin)
    t.start()
    inside = 0
    try:
        time.sleep(0.05)
        for _ in range(3):
            t0 = time.perf_counter()
            out = copy_out(buf, 0, size)
            t1 = time.perf_counter()
            assert len(out) == size and out[-1] == 0x5A
            del out
            q = (t1 - t0) / 4
            inside += sum(1 for x in notes if t0 + q < x < t1 - q)
    finally:
        stop.set()
        t.join()
        buf.close()
    assert inside > 0
