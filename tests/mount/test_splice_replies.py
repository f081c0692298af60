"""READ replies by splice (fuse.splice, native/fuse_reply.c "Replies by splice").

A READ reply of 256 KiB or more goes from the memory tier's pages through a pipe
(vmsplice, then splice to /dev/fuse) when the whole reply fits the thread's pipe; a
smaller one, one that does not fit (a 1 MiB READ's under the default fs.pipe-max-size),
or any with ``fuse.splice=false`` is written (writev). Either way the reader gets the
file's bytes; ``spliced``/``spliced_bytes`` in the stats xattr count what went by
splice."""
from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from tests.fixtures.mounts import Cluster1
from tests.fixtures.mounts import mount_stats as _stats

BIG = 32 << 20
SMALL = 100_000

pytestmark = pytest.mark.skipif(os.environ.get("KSPEEDFS_FUSE_ENGINE", "native") != "native",
                                reason="the native engine's replies")


def _read_uncached(path: Path, size: int) -> bytes:
    """``path`` read ``size`` bytes at a time, its page cache dropped first: every READ
    reaches the daemon (answered from the memory tier, in C)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        parts = []
        while b := os.read(fd, size):
            parts.append(b)
        return b"".join(parts)
    finally:
        os.close(fd)


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("splice")
    src = base / "src"
    src.mkdir()
    rng = random.Random(5)
    (src / "big.bin").write_bytes(rng.randbytes(BIG))
    (src / "small.bin").write_bytes(rng.randbytes(SMALL))
    c = Cluster1(base)
    c.import_(src, "spl")
    try:
        yield c, src
    finally:
        c.close()


def test_large_read_replies_are_spliced_and_byte_exact(tree) -> None:
    from kspeedfs.fuse import _engine
    c, src = tree
    mnt = c.mount("spl", None, "--cache-mem", "256MiB")
    want = (src / "big.bin").read_bytes()
    assert (mnt / "big.bin").read_bytes() == want       # into the memory tier
    before = _stats(mnt)
    for _ in range(2):
        assert _read_uncached(mnt / "big.bin", 1 << 20) == want
    after = _stats(mnt)
    spliced = after["spliced"] - before["spliced"]
    nbytes = after["spliced_bytes"] - before["spliced_bytes"]
    if _engine.splice_room() >= 1 << 20:
        # every 1 MiB READ of the two passes (readahead may cut a few shorter)
        assert nbytes >= 2 * BIG * 3 // 4, (spliced, nbytes)
    else:
        # fs.pipe-max-size keeps 1 MiB replies out of the pipe: they are written, shorter
        # readahead READs (≥ 256 KiB) may still go by splice; the log says why
        assert nbytes <= 2 * BIG, (spliced, nbytes)
        assert "larger ones by writev" in c.log_text()
    assert nbytes >= spliced * (256 << 10)


def test_small_replies_and_splice_off_are_written(tree) -> None:
    c, src = tree
    on = c.mount("spl", None, "--cache-mem", "256MiB")
    off = c.mount("spl", None, "--cache-mem", "256MiB", "--set", "fuse.splice=false")
    small = (src / "small.bin").read_bytes()
    big = (src / "big.bin").read_bytes()
    for mnt in (on, off):
        assert (mnt / "small.bin").read_bytes() == small
        assert (mnt / "big.bin").read_bytes() == big
    before = {m: _stats(m) for m in (on, off)}
    assert _read_uncached(on / "small.bin", 1 << 20) == small     # one ~100 KB reply
    assert _read_uncached(off / "big.bin", 1 << 20) == big
    assert _stats(on)["spliced"] == before[on]["spliced"]
    assert _stats(off)["spliced"] == before[off]["spliced"] == 0
