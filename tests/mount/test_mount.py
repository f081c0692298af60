"""A real mount of the edge-case tree: bytes, metadata, read-only semantics, xattrs.

One mount per module (import + mount cost ~1 s); every test reads through the kernel.
"""
from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import random
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fixtures.mounts import CHUNK, Cluster1, assert_same_tree, files_below, make_tree


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("t4")
    src = make_tree(base / "src")
    c = Cluster1(base)
    c.import_(src, "edge")
    mnt = c.mount("edge")
    try:
        yield c, src, mnt
    finally:
        c.close()


def test_every_file_byte_exact(node) -> None:
    c, src, mnt = node
    assert assert_same_tree(src, mnt) > 9 * CHUNK
    # and again, now from the daemon's memory tier
    assert_same_tree(src, mnt)


def test_hostile_names_and_symlinks(node) -> None:
    _, src, mnt = node
    names = set(os.listdir(os.fsencode(mnt / "names")))
    assert b"latin1-\xe9\xff" in names and b"new\nline" in names and b"x" * 255 in names
    assert os.readlink(mnt / "names" / "link-to-one") == "../one"
    assert (mnt / "names" / "link-to-one").read_bytes() == (src / "one").read_bytes()
    assert os.readlink(mnt / "names" / "dangling") == "nowhere"
    with pytest.raises(FileNotFoundError):
        (mnt / "names" / "dangling").read_bytes()
    with pytest.raises(FileNotFoundError):
        os.stat(mnt / "no-such-file")
    assert oct((mnt / "one").stat().st_mode & 0o777) == oct(0o600)
    assert list((mnt / "empty-dir").iterdir()) == []


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_random_offsets_and_lengths(node, data) -> None:
    _, src, mnt = node
    rels = _candidates(src)
    rel = data.draw(st.sampled_from(rels))
    size = os.path.getsize(os.path.join(os.fsencode(src), rel))
    off = data.draw(st.integers(0, size + 10))
    length = data.draw(st.integers(0, 3 * CHUNK))
    with open(os.path.join(os.fsencode(src), rel), "rb") as a, \
            open(os.path.join(os.fsencode(mnt), rel), "rb") as b:
        assert os.pread(a.fileno(), length, off) == os.pread(b.fileno(), length, off)


_CANDIDATES: list[bytes] = []


def _candidates(src: Path) -> list[bytes]:
    if not _CANDIDATES:
        every = files_below(src)
        big = [p for p in every if not p.startswith(b"small/")]
        _CANDIDATES.extend(big + random.Random(3).sample([p for p in every if p.startswith(b"small/")], 50))
    return _CANDIDATES


def test_concurrent_readers_same_chunk(node) -> None:
    """Many threads on one file: all get the same bytes (single-flight in the daemon)."""
    from concurrent.futures import ThreadPoolExecutor

    _, src, mnt = node
    want = (src / "many-chunks.bin").read_bytes()

    def read(i: int) -> bool:
        with open(mnt / "many-chunks.bin", "rb") as f:
            f.seek(i * 1000)
            return f.read() == want[i * 1000:]

    with ThreadPoolExecutor(16) as pool:
        assert all(pool.map(read, range(32)))


def _via_mmap(fd: int, size: int) -> bytes:
    if size == 0:
        return b""                                  # mmap(2) of 0 bytes is EINVAL anywhere
    with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as m:
        return m[:]


def _via_pipe(move) -> bytes:
    """Bytes moved by ``move(pipe_write_fd, offset)`` in 64 KiB steps, until it moves 0."""
    r, w = os.pipe()
    out, off = bytearray(), 0
    try:
        while n := move(w, off):
            out += os.read(r, n)
            off += n
    finally:
        os.close(r)
        os.close(w)
    return bytes(out)


@pytest.mark.parametrize("how", ["mmap", "sendfile", "splice"])
def test_mmap_sendfile_and_splice_read_the_same_bytes(node, how: str) -> None:
    """The I/O paths beside read(2) that frameworks take: numpy.memmap and safetensors
    map files, shutil copies with sendfile, servers splice. The file's pages are dropped
    first, so the kernel asks the daemon."""
    _, src, mnt = node
    small = [p for p in files_below(src) if p.startswith(b"small/")]
    rels = [b"empty", b"one", b"sizes/chunk-1", b"sizes/chunk", b"sizes/chunk+1",
            b"many-chunks.bin", *random.Random(5).sample(small, 20)]
    for rel in rels:
        with open(os.path.join(os.fsencode(src), rel), "rb") as f:
            want = f.read()
        fd = os.open(os.path.join(os.fsencode(mnt), rel), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            if how == "mmap":
                got = _via_mmap(fd, len(want))
            elif how == "sendfile":
                got = _via_pipe(lambda w, off, fd=fd: os.sendfile(w, fd, off, 65536))
            else:
                got = _via_pipe(lambda w, off, fd=fd: os.splice(fd, w, 65536, offset_src=off))
        finally:
            os.close(fd)
        assert got == want, (how, rel, len(got), len(want))


@pytest.mark.parametrize("call", [
    lambda m: open(m / "one", "wb"),
    lambda m: open(m / "one", "r+b"),
    lambda m: open(m / "one", "ab"),
    lambda m: os.open(m / "new-file", os.O_CREAT | os.O_WRONLY, 0o644),
    lambda m: os.mkdir(m / "newdir"),
    lambda m: os.unlink(m / "one"),
    lambda m: os.rmdir(m / "empty-dir"),
    lambda m: os.rename(m / "one", m / "two"),
    lambda m: os.symlink("x", m / "newlink"),
    lambda m: os.link(m / "one", m / "hard"),
    lambda m: os.chmod(m / "one", 0o777),
    lambda m: os.truncate(m / "one", 0),
    lambda m: os.utime(m / "one", (1, 1)),
    lambda m: os.setxattr(m / "one", "user.x", b"1"),
], ids=["open-wb", "open-rw", "open-append", "create", "mkdir", "unlink", "rmdir", "rename",
        "symlink", "link", "chmod", "truncate", "utime", "setxattr"])
def test_writes_get_erofs(node, call) -> None:
    _, _, mnt = node
    with pytest.raises(OSError) as e:
        call(mnt)
    assert e.value.errno == errno.EROFS


def test_xattrs(node) -> None:
    _, src, mnt = node
    names = os.listxattr(mnt / "many-chunks.bin")
    assert "user.kspeedfs.checksum" in names
    value = os.getxattr(mnt / "many-chunks.bin", "user.kspeedfs.checksum").decode()
    algo, _, digests = value.partition(":")
    assert algo == "xxh3-128" and len(digests.split(",")) == 10   # 9 chunks + a tail
    import xxhash

    first = (src / "many-chunks.bin").read_bytes()[:CHUNK]
    assert digests.split(",")[0] == xxhash.xxh3_128_hexdigest(first)
    stats = json.loads(os.getxattr(mnt, "user.kspeedfs.stats"))
    assert stats["read_bytes"] > 0 and stats["corrupt_discarded"] == 0
    with pytest.raises(OSError) as e:
        os.getxattr(mnt / "one", "user.nope")
    assert e.value.errno == errno.ENODATA


def test_random_reads_load_blocks_not_chunks(node) -> None:
    """A fresh mount, a reader that says it reads at random (as fio does): each 4 KiB
    read that misses loads its 128 KiB block from the source, never a whole chunk."""
    c, src, _ = node
    mnt = c.mount("edge")
    data = (src / "many-chunks.bin").read_bytes()
    offsets = [3 * CHUNK + 5000, 7 * CHUNK + 200_000, 1000, 5 * CHUNK + (128 << 10) - 2048]
    with open(mnt / "many-chunks.bin", "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        for off in offsets:
            assert os.pread(f.fileno(), 4096, off) == data[off:off + 4096]
    stats = json.loads(os.getxattr(mnt, "user.kspeedfs.stats"))
    assert stats["source_loads"] == 0 and stats["block_reads"] >= len(offsets), stats
    assert stats["source_blocks"] == 5, stats             # the last read spans two blocks
    assert stats["source_bytes"] == stats["source_blocks"] * (128 << 10)


def test_python_buffered_records_load_blocks(node) -> None:
    """A map-style dataset's record reader: plain ``open()``, seek + read(4096). Python
    buffers ``st_blksize`` bytes per read, so st_blksize is at most the block size (4 KiB
    on the native engine, the 128 KiB block on pyfuse3): each record costs one small READ
    (two blocks at most), not a chunk (4 MiB when st_blksize was the chunk size)."""
    c, src, _ = node
    mnt = c.mount("edge")
    data = (src / "many-chunks.bin").read_bytes()
    native = "native engine" in c.log_text()
    assert os.stat(mnt / "many-chunks.bin").st_blksize == (4096 if native else 128 << 10)
    offsets = [3 * CHUNK + 8192, 8 * CHUNK + 100_000, 6 * CHUNK + 40_960]
    with open(mnt / "many-chunks.bin", "rb") as f:
        for off in offsets:
            f.seek(off)
            assert f.read(4096) == data[off:off + 4096]
    stats = json.loads(os.getxattr(mnt, "user.kspeedfs.stats"))
    assert stats["source_loads"] == 0, stats
    assert len(offsets) <= stats["source_blocks"] <= 2 * len(offsets), stats


def test_xattrs_off_by_default_so_ls_l_asks_nothing(node) -> None:
    """Without ``fuse.xattrs`` the daemon answers ENOSYS once and the kernel stops asking:
    a user's ``ls -l`` (which reads two xattrs of every entry) costs no GETXATTR."""
    from tests.mount.test_metrics import free_port, scrape, value

    c, src, _ = node
    port = free_port()
    mnt = c.mount("edge", None, "--set", "fuse.xattrs=false",
                  "--set", f"metrics.listen=127.0.0.1:{port}")
    with pytest.raises(OSError) as e:
        os.getxattr(mnt, "user.kspeedfs.stats")
    assert e.value.errno == errno.EOPNOTSUPP
    out = subprocess.run(["ls", "-l", str(mnt / "small" / "d0")], capture_output=True, text=True)
    assert out.returncode == 0 and len(out.stdout.splitlines()) > 100
    _, samples = scrape(port)                  # whichever engine answered, it counted them
    asked = value(samples, "kspeedfs_fuse_operations_total", op="getxattr")
    assert asked == 1, samples                 # ours, answered ENOSYS; none from ls -l


def test_statfs(node) -> None:
    c, src, mnt = node
    st = os.statvfs(mnt)
    total = sum(os.path.getsize(os.path.join(os.fsencode(src), p)) for p in files_below(src))
    assert st.f_bsize * st.f_blocks >= total
    assert st.f_bavail == 0 and st.f_namemax == 255
    assert st.f_flag & os.ST_RDONLY


def test_mount_options(node) -> None:
    _, _, mnt = node
    with open("/proc/self/mountinfo") as f:
        line = next(line for line in f if line.split()[4] == str(mnt))
    assert "ro" in line.split()[5].split(",")
    assert "fuse.kspeedfs" in line and "default_permissions" in line
    assert "allow_other" not in line


def test_big_directory_readdir(tmp_path: Path) -> None:
    """100k entries in one directory list completely, names and attributes right."""
    src = tmp_path / "src"
    (src / "big").mkdir(parents=True)
    n = 100_000
    for i in range(n):
        (src / "big" / f"f{i:06d}").write_bytes(b"")
    (src / "big" / "f000042").write_bytes(b"forty-two")
    with _single(tmp_path, src) as mnt:
        with os.scandir(mnt / "big") as it:
            entries = {e.name: e for e in it}
        assert len(entries) == n
        assert entries["f000042"].stat().st_size == 9
        assert (mnt / "big" / "f099999").exists()
        assert (mnt / "big" / "f000042").read_bytes() == b"forty-two"


def test_a_file_past_4_gib_reads_right_at_64_bit_offsets(tmp_path: Path) -> None:
    """Record shards of several GiB are common: bytes past 2**32 (and across it, where a
    chunk ends) come back from the right place. The source file is sparse (~5 s of
    import hashing, no disk)."""
    src = tmp_path / "src"
    src.mkdir()
    size = (1 << 32) + (1 << 20) + 12345
    marks = {0: b"START", (1 << 32) - 3: b"STRADDLE", (1 << 32) + 123: b"PAST-4GIB",
             size - 7: b"THE-END"}
    with open(src / "shard.rec", "wb") as f:
        f.truncate(size)
        for off, mark in marks.items():
            f.seek(off)
            f.write(mark)
    with _single(tmp_path, src) as mnt:
        assert os.stat(mnt / "shard.rec").st_size == size
        fd = os.open(mnt / "shard.rec", os.O_RDONLY)
        try:
            for off, mark in marks.items():
                lo = max(0, off - 2)
                want = (b"\0" * (off - lo) + mark + b"\0\0")[:size - lo]
                assert os.pread(fd, len(want), lo) == want, off
            assert os.pread(fd, 100, size - 3) == b"END"
            assert os.pread(fd, 100, size + (1 << 33)) == b""
        finally:
            os.close(fd)


def _as_nobody(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                           "sha256sum", str(path)], capture_output=True, text=True)


def test_other_users_read_with_allow_other_as_the_mode_bits_say() -> None:
    """A training job often runs as another user than the mount daemon (root): without
    ``fuse.allow_other`` the kernel lets nobody else in; with it, each file's mode bits
    from the source decide (``default_permissions``)."""
    base = Path(tempfile.mkdtemp(prefix="kspeedfs-others-"))   # pytest's tmp is root-only
    try:
        os.chmod(base, 0o755)
        src = base / "src"
        (src / "d").mkdir(parents=True)
        (src / "d" / "shared.bin").write_bytes(random.Random(7).randbytes(3 * CHUNK + 5))
        (src / "d" / "secret.bin").write_bytes(b"root only")
        os.chmod(src / "d" / "shared.bin", 0o644)
        os.chmod(src / "d" / "secret.bin", 0o600)
        c = Cluster1(base)
        try:
            c.import_(src, "others")
            private = c.mount("others")
            shared = c.mount("others", None, "--set", "fuse.allow_other=true")
            r = _as_nobody(private / "d" / "shared.bin")
            assert r.returncode != 0 and "Permission denied" in r.stderr
            r = _as_nobody(shared / "d" / "shared.bin")
            want = hashlib.sha256((src / "d" / "shared.bin").read_bytes()).hexdigest()
            assert r.returncode == 0 and r.stdout.split()[0] == want, r.stderr
            r = _as_nobody(shared / "d" / "secret.bin")
            assert r.returncode != 0 and "Permission denied" in r.stderr
        finally:
            c.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _single(tmp_path: Path, src: Path):
    import contextlib

    @contextlib.contextmanager
    def cm():
        c = Cluster1(tmp_path)
        try:
            c.import_(src, "one")
            yield c.mount("one")
        finally:
            c.close()

    return cm()
