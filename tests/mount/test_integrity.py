"""A reader never sees wrong bytes: corrupt cache tiers, a source changed after import."""
from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest

from tests.fixtures.mounts import CHUNK, assert_same_tree, cluster1, make_tree
from tests.fixtures.mounts import mount_stats as _stats


def test_corrupt_disk_tier_is_discarded(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", small_files=200)
    cache = tmp_path / "cache"
    with cluster1(tmp_path) as c:
        c.import_(src, "ds")
        tier = ["--cache-dir", str(cache), "--cache-disk", "64MiB"]
        mnt = c.mount("ds", None, *tier)
        assert_same_tree(src, mnt)
        c.close()
        c.mounts.clear()
        chunks = [p for p in cache.rglob("*") if p.is_file() and not p.name.startswith(".")]
        assert len(chunks) > 10
        for p in chunks[::2]:                     # flip a byte in every other cached chunk
            data = bytearray(p.read_bytes())
            data[len(data) // 2] ^= 0xFF
            p.write_bytes(bytes(data))
        mnt = c.mount("ds", None, *tier)
        assert_same_tree(src, mnt)
        s = _stats(mnt)
        assert s["corrupt_discarded"] >= len(chunks[::2])
        assert s["disk_hits"] > 0
        assert "failed its checksum" in c.log_text()


def test_source_changed_after_import(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", small_files=100)
    with cluster1(tmp_path) as c:
        c.import_(src, "ds")
        victim = src / "small" / "d1" / "img00005.jpg"
        neighbour = src / "small" / "d1" / "img00009.jpg"   # packed in the same chunk
        data = bytearray(victim.read_bytes())
        data[0] ^= 0x01                                      # same size, other bytes
        victim.write_bytes(bytes(data))
        big = src / "many-chunks.bin"
        with open(big, "r+b") as f:                          # a chunk in the middle of a big file
            f.seek(3 * CHUNK + 5)
            f.write(b"\0\1\2")
        mnt = c.mount("ds")
        with pytest.raises(OSError) as e:
            (mnt / "small" / "d1" / "img00005.jpg").read_bytes()
        assert e.value.errno == errno.EIO
        assert (mnt / "small" / "d1" / "img00009.jpg").read_bytes() == neighbour.read_bytes()
        with open(mnt / "many-chunks.bin", "rb") as f:
            assert f.read(CHUNK) == big.read_bytes()[:CHUNK]  # chunks before the change
            f.seek(3 * CHUNK)
            with pytest.raises(OSError) as e:
                f.read(CHUNK)
            assert e.value.errno == errno.EIO
        log = c.log_text()
        assert "img00005.jpg" in log and "re-import" in log
        assert _stats(mnt)["source_changed"] >= 1
        assert _stats(mnt)["source_partial_reads"] >= 1       # the neighbour, served anyway
        # re-import fixes it; the old mount keeps its version, a new mount sees the new one
        c.import_(src, "ds")
        mnt2 = c.mount("ds")
        assert_same_tree(src, mnt2)
        assert os.getxattr(mnt2, "user.kspeedfs.dataset") == b"ds@2"
        assert os.getxattr(mnt, "user.kspeedfs.dataset") == b"ds@1"


def test_source_file_deleted(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", small_files=10)
    with cluster1(tmp_path) as c:
        c.import_(src, "ds")
        (src / "one").unlink()
        mnt = c.mount("ds")
        with pytest.raises(OSError) as e:
            (mnt / "one").read_bytes()
        assert e.value.errno == errno.EIO
        assert (mnt / "sizes" / "chunk").read_bytes() == (src / "sizes" / "chunk").read_bytes()


def test_page_cache_push_serves_exact_bytes(tmp_path: Path) -> None:
    """With ``fuse.push_pages`` the prefetched chunks reach the reader through the page
    cache (FUSE_NOTIFY_STORE), not READ replies: the bytes must still be exact, the file
    must not grow, and the reader must not ask for the pushed pages again."""
    src = make_tree(tmp_path / "src", small_files=50)
    big = src / "many-chunks.bin"
    with cluster1(tmp_path) as c:
        c.import_(src, "ds")
        # a small readahead window, so the kernel does not ask for the whole file at once
        mnt = c.mount("ds", None, "--set", "fuse.push_pages=true", "--set", "fuse.read_ahead_kb=128",
                      "--set", "fuse.prefetch_chunks=8")
        want = big.read_bytes()
        with open(mnt / "many-chunks.bin", "rb", buffering=0) as f:
            head = b"".join(f.read(64 << 10) for _ in range(4))   # sequential: prefetch opens
            for _ in range(100):
                if _stats(mnt)["pushed_bytes"] >= 6 * CHUNK:
                    break
                time.sleep(0.05)
            before = _stats(mnt)["read_bytes"]
            rest = f.read()
            asked = _stats(mnt)["read_bytes"] - before
        assert head + rest == want
        assert os.stat(mnt / "many-chunks.bin").st_size == len(want)
        s = _stats(mnt)
        assert s["pushed_bytes"] >= 6 * CHUNK and s["push_failures"] == 0
        assert asked < len(rest) - 4 * CHUNK      # most of the rest came from pushed pages
        assert_same_tree(src, mnt)


def test_a_sequential_reader_keeps_its_prefetch_through_a_small_tier(tmp_path: Path) -> None:
    """A prefetched chunk stops counting against the prefetch budget once a read has
    reached it, whichever engine answered that read: the native engine's C threads
    answer from the tier without ``Reader.chunk`` seeing it, and before the tier told
    the reader (``MemoryCache.served``) the budget stayed full of chunks already read,
    so 79-98 % of a peer-reading mount's prefetches were skipped. 96 chunks through an
    8 MiB tier (the least): a budget of 16 chunks."""
    src = tmp_path / "src"
    src.mkdir()
    want = os.urandom(96 * CHUNK)
    (src / "big.bin").write_bytes(want)
    with cluster1(tmp_path) as c:
        c.import_(src, "ds")
        mnt = c.mount("ds", None, "--cache-mem", "8MiB", "--set", "fuse.prefetch_chunks=4",
                      "--set", "fuse.read_ahead_kb=128")
        got = bytearray()
        with open(mnt / "big.bin", "rb", buffering=0) as f:   # a reader slower than prefetch:
            while block := f.read(128 << 10):              # its READs are hits in the tier
                got += block
                time.sleep(0.002)
        assert got == want
        s = _stats(mnt)
    # without: 48 prefetched, 47 skipped (the budget full of chunks already read)
    assert s["prefetched"] >= 80 and s["prefetch_skipped"] <= 8, s
