"""The files behind a node's arena (``cluster/arena_files.py``): a root node never follows,
truncates or maps a file another user could plant or read, two clusters never share
one, and a running node's files cannot be dropped.

The planted files are made by a process running as ``nobody``, as an attacker on the
host would, with ``fs.protected_symlinks`` and ``fs.protected_regular`` off (some hosts
have them off; the checks must not lean on them)."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kspeedfs.cluster import arena_files
from kspeedfs.cluster.arena_files import ArenaFiles, cluster_tag, private_directory
from kspeedfs.errors import DatasetInUse, UnsafePath

NOBODY = 65534
ARENA, INDEX = 1 << 20, 64 << 10

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a root node, a nobody attacker)")


@pytest.fixture
def sysctls_off() -> Iterator[None]:
    """``fs.protected_symlinks`` and ``fs.protected_regular`` at 0 for the test."""
    keys = [Path("/proc/sys/fs/protected_symlinks"), Path("/proc/sys/fs/protected_regular")]
    before = [k.read_text() for k in keys]
    for k in keys:
        k.write_text("0")
    try:
        yield
    finally:
        for k, v in zip(keys, before, strict=False):
            k.write_text(v)


@pytest.fixture
def shm() -> Iterator[Path]:
    """A world-writable sticky directory in tmpfs, like ``/dev/shm`` itself."""
    d = Path(tempfile.mkdtemp(prefix="kspeedfs-test-shm-", dir="/dev/shm"))
    d.chmod(0o1777)
    try:
        yield d
    finally:
        subprocess.run(["rm", "-rf", str(d)], check=False)


def as_nobody(code: str) -> None:
    """Run ``code`` (Python) as uid/gid nobody, as a local attacker would."""
    subprocess.run([sys.executable, "-c", code], user=NOBODY, group=NOBODY, check=True,
                   cwd="/")


def test_the_directory_is_made_private(shm: Path) -> None:
    d = shm / "kspeedfs"
    os.close(private_directory(str(d)))
    st = d.lstat()
    assert stat.S_ISDIR(st.st_mode) and st.st_mode & 0o777 == 0o700 and st.st_uid == 0


def test_a_shared_directory_is_refused(shm: Path) -> None:
    """``/dev/shm`` itself (the old default) lets every user in: refused, in one line."""
    with pytest.raises(UnsafePath, match="group or others may enter"):
        private_directory(str(shm))


def test_a_directory_planted_by_another_user_is_refused(shm: Path, sysctls_off: None) -> None:
    as_nobody(f"import os; os.mkdir({str(shm / 'kspeedfs')!r}, 0o700)")
    with pytest.raises(UnsafePath, match=f"belongs to uid {NOBODY}"):
        private_directory(str(shm / "kspeedfs"))


def test_a_symlinked_directory_is_refused(shm: Path, sysctls_off: None, tmp_path: Path) -> None:
    """nobody points the arena directory at a root directory: not followed."""
    target = tmp_path / "root-dir"
    target.mkdir(mode=0o700)
    as_nobody(f"import os; os.symlink({str(target)!r}, {str(shm / 'kspeedfs')!r})")
    with pytest.raises(UnsafePath, match="symbolic link"):
        private_directory(str(shm / "kspeedfs"))
    assert list(target.iterdir()) == []


def test_an_ancestor_others_may_write_is_refused(tmp_path: Path) -> None:
    """A parent others may write (and not sticky) lets them swap the directory."""
    parent = tmp_path / "open"
    parent.mkdir()
    parent.chmod(0o777)
    with pytest.raises(UnsafePath, match="not sticky"):
        private_directory(str(parent / "kspeedfs"))


def _files(directory: Path, secret: bytes = b"s" * 32, node: str = "n1") -> ArenaFiles:
    return ArenaFiles(str(directory), cluster_tag(secret, "/kspeedfs/"), node)


def test_a_symlink_at_the_arena_name_is_not_followed(tmp_path: Path) -> None:
    """The reported exploit, inside a directory whose owner planted the link: the root
    file it points to is neither truncated nor zeroed, and the node refuses to start."""
    d = tmp_path / "arena"
    os.close(private_directory(str(d)))
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious" * 1000)
    files = _files(d)
    os.symlink(victim, files.paths[0])
    with pytest.raises(UnsafePath, match="symbolic link"):
        files.open(ARENA, INDEX)
    assert victim.read_bytes() == b"precious" * 1000


@pytest.mark.parametrize("planted", ["world-writable", "other owner", "hard link"])
def test_a_planted_file_is_refused(tmp_path: Path, planted: str) -> None:
    d = tmp_path / "arena"
    os.close(private_directory(str(d)))
    files = _files(d)
    path = Path(files.paths[0])
    path.write_bytes(b"x" * ARENA)
    if planted == "world-writable":
        path.chmod(0o666)
        why = "mode 0666"
    elif planted == "other owner":
        os.chown(path, NOBODY, NOBODY)
        why = f"belongs to uid {NOBODY}"
    else:
        path.chmod(0o600)
        os.link(path, tmp_path / "elsewhere")
        why = "2 links"
    with pytest.raises(UnsafePath, match=why):
        files.open(ARENA, INDEX)
    assert path.read_bytes() == b"x" * ARENA            # neither truncated nor mapped


def test_two_clusters_on_one_host_keep_apart(shm: Path) -> None:
    """Nodes ``n1`` of two clusters (other secrets) have their own files; a second node
    ``n1`` of the same cluster is refused while the first runs."""
    d = shm / "kspeedfs"
    a, b = _files(d, b"a" * 32), _files(d, b"b" * 32)
    arena_a, index_a, _ = a.open(ARENA, INDEX)
    arena_a[:5] = b"hello"
    arena_b, _, kept = b.open(ARENA, INDEX)
    assert not kept and arena_b[:5] == bytes(5)
    assert set(a.paths).isdisjoint(b.paths)
    with pytest.raises(DatasetInUse, match="already runs"):
        _files(d, b"a" * 32).open(ARENA, INDEX, wait=0.2)
    a.close()
    arena_a.close()
    index_a.close()
    again = _files(d, b"a" * 32)
    arena, _, kept = again.open(ARENA, INDEX)
    assert kept and arena[:5] == b"hello"              # a restart keeps what it held
    again.close()
    b.close()


def test_listing_and_drop(shm: Path) -> None:
    d = shm / "kspeedfs"
    files = _files(d)
    arena, index, _ = files.open(ARENA, INDEX)
    arena[: 256 << 10] = b"y" * (256 << 10)
    usage = files.usage()
    assert usage[str(d / (files.stem + ".arena.*"))] >= 256 << 10 and files.index_path in usage
    listed = {f.path: f for f in arena_files.listing(str(d))}
    assert set(listed) == set(files.paths) and all(f.in_use for f in listed.values())
    tag = cluster_tag(b"s" * 32, "/kspeedfs/")
    with pytest.raises(DatasetInUse, match="stop it first"):
        arena_files.drop(str(d), tag, "n1")
    files.close()
    arena.close()
    index.close()
    gone = arena_files.drop(str(d), tag, "n1")
    assert {f.path for f in gone} == set(files.paths)
    assert arena_files.listing(str(d)) == []
    assert arena_files.drop(str(d), tag, "n1") == []


def test_listing_and_drop_of_a_missing_directory_find_nothing_and_make_nothing(
        shm: Path) -> None:
    d = shm / "kspeedfs"
    tag = cluster_tag(b"s" * 32, "/kspeedfs/")
    assert arena_files.listing(str(d)) == []
    assert arena_files.drop(str(d), tag, "n1") == []
    assert not d.exists()
    (shm / "file").write_bytes(b"")          # not a directory: refused, as before
    with pytest.raises(UnsafePath, match="cannot be opened as a directory"):
        arena_files.listing(str(shm / "file"))


def test_cli_lists_and_drops(shm: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)
    d = shm / "kspeedfs"
    files = ArenaFiles(str(d), cluster_tag(secret.read_text().strip().encode(), "/kspeedfs/"), "n7")
    files.open(ARENA, INDEX)
    files.close()
    def ks(*args: str, arena_dir: Path = d) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "kspeedfs.cli.app", "arena", *args,
                               "--set", f"cluster.secret_file={secret}",
                               "--set", f"cluster.arena_dir={arena_dir}"],
                              capture_output=True, text=True)

    out = ks()
    assert out.returncode == 0 and "n7" in out.stdout and "this" in out.stdout, out.stderr
    out = ks("drop", "n7")
    assert out.returncode == 0 and "dropped node n7's arena" in out.stdout, out.stderr
    out = ks("drop", "n7")
    assert out.returncode == 1 and "no arena of node n7" in out.stderr
    assert out.stderr.count("\n") == 1
    out = ks(arena_dir=Path("/dev/shm"))
    assert out.returncode == 1 and "group or others may enter" in out.stderr, out.stderr
    assert out.stderr.count("\n") == 1


def test_a_restarted_node_waits_for_its_predecessor(shm: Path) -> None:
    """A node started while its killed predecessor still exits gets the files once the
    predecessor is gone, not an error."""
    d = shm / "kspeedfs"
    proc = subprocess.Popen([sys.executable, "-c", f"""
import sys, time
from kspeedfs.cluster.arena_files import ArenaFiles, cluster_tag
f = ArenaFiles({str(d)!r}, cluster_tag(b"s" * 32, "/kspeedfs/"), "n1")
f.open({ARENA}, {INDEX})
print("held", flush=True)
time.sleep(60)
"""], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "held\n"
        import threading
        threading.Timer(0.5, proc.kill).start()
        arena, index, kept = _files(d).open(ARENA, INDEX, wait=10)
        assert kept
        arena.close()
        index.close()
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


SEGMENT = 256 << 10


def _segmented(shm: Path) -> tuple[ArenaFiles, Path]:
    d = shm / "kspeedfs"
    return _files(d), d


def test_segments_are_files_mapped_as_one_range(shm: Path) -> None:
    """Segment i's file and the arena at i × segment_bytes are the same bytes, both ways;
    the last segment is shorter; a restart keeps them."""
    files, d = _segmented(shm)
    arena, index, _ = files.open(ARENA - SEGMENT // 2, INDEX, segment_bytes=SEGMENT)
    assert len(arena) == ARENA - SEGMENT // 2 and files.nsegments == 4
    assert [os.path.getsize(p) for p in files.paths[:-1]] == [SEGMENT] * 3 + [SEGMENT // 2]
    arena[2 * SEGMENT + 5: 2 * SEGMENT + 10] = b"hello"
    with open(files.paths[2], "rb") as f:
        assert f.read(10)[5:] == b"hello"
    with open(files.paths[3], "r+b") as f:
        f.seek(7)
        f.write(b"world")
    assert arena[3 * SEGMENT + 7: 3 * SEGMENT + 12] == b"world"
    assert files.segments is not None
    ro = files.segments.readonly(3)
    try:
        assert os.pread(ro, 5, 7) == b"world"
    finally:
        os.close(ro)
    files.close()
    arena.close()
    index.close()
    again = _files(d)
    arena, index, kept = again.open(ARENA - SEGMENT // 2, INDEX, segment_bytes=SEGMENT)
    assert kept and arena[2 * SEGMENT + 5: 2 * SEGMENT + 10] == b"hello"
    again.close()
    arena.close()
    index.close()


def test_a_readonly_segment_fd_cannot_write(shm: Path) -> None:
    import mmap

    files, _ = _segmented(shm)
    arena, index, _ = files.open(ARENA, INDEX, segment_bytes=SEGMENT)
    assert files.segments is not None
    ro = files.segments.readonly(1)
    try:
        with pytest.raises(PermissionError):
            mmap.mmap(ro, SEGMENT, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(OSError):
            os.write(ro, b"x")
        with pytest.raises(OSError):
            os.ftruncate(ro, 0)
        view = mmap.mmap(ro, SEGMENT, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        arena[SEGMENT:SEGMENT + 3] = b"abc"
        assert view[:3] == b"abc"
        view.close()
    finally:
        os.close(ro)
        files.close()
        arena.close()
        index.close()


def test_a_symlink_at_a_later_segment_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "arena"
    os.close(private_directory(str(d)))
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    files = _files(d)
    os.symlink(victim, d / (files.stem + ".arena.2"))
    with pytest.raises(UnsafePath, match="symbolic link"):
        files.open(ARENA, INDEX, segment_bytes=SEGMENT)
    assert victim.read_bytes() == b"precious"


def test_an_older_single_arena_and_stale_segments_are_removed_and_dropped(shm: Path) -> None:
    """A node of an older layout left ``.arena``; a node with a larger segment count
    left ``.arena.<i>`` past the last: the next open removes them, fresh (nothing
    adopted from an index of other slots); listing and drop see every kind."""
    files, d = _segmented(shm)
    d.mkdir(mode=0o700)
    for name in (files.stem + ".arena", files.stem + ".arena.9", files.stem + ".index"):
        (d / name).write_bytes(b"z" * 4096)
        (d / name).chmod(0o600)
    listed = {os.path.basename(f.path) for f in arena_files.listing(str(d))}
    assert listed == {files.stem + s for s in (".arena", ".arena.9", ".index")}
    arena, index, kept = files.open(ARENA, INDEX, segment_bytes=SEGMENT)
    assert not kept and index[:4096] == bytes(4096)
    assert sorted(os.listdir(d)) == sorted(os.path.basename(p) for p in files.paths)
    files.close()
    arena.close()
    index.close()
    (d / (files.stem + ".arena")).write_bytes(b"old")
    (d / (files.stem + ".arena")).chmod(0o600)
    gone = arena_files.drop(str(d), cluster_tag(b"s" * 32, "/kspeedfs/"), "n1")
    assert len(gone) == 4 + 1 + 1 and os.listdir(d) == []


def test_memfd_segments_are_one_range_too() -> None:
    from kspeedfs.cluster.arena import Geometry
    from kspeedfs.cluster.arena_segments import SegmentMemory

    g = Geometry.for_memory(10 * 65536, 65536, segment_bytes=4 * 65536)
    seg = SegmentMemory.anonymous(g, "n1")
    try:
        assert len(seg.fds) == 3 and len(seg.memory) == g.arena_bytes
        seg.memory[9 * 65536: 9 * 65536 + 4] = b"tail"
        assert os.pread(seg.fds[2], 4, 65536) == b"tail"
        os.pwrite(seg.fds[0], b"head", 100)
        assert seg.memory[100:104] == b"head"
        assert stat.S_IMODE(os.fstat(seg.fds[1]).st_mode) == 0o600
        ro = seg.readonly(2)
        assert os.pread(ro, 4, 65536) == b"tail"
        os.close(ro)
    finally:
        seg.close()
        seg.memory.close()


def test_a_restart_after_a_grant_gives_the_segments_new_inodes(shm: Path) -> None:
    """A reader granted a segment before the restart keeps its mapping of the old inode:
    the new run keeps the bytes (and holes) in new inodes, which it never sees."""
    import mmap

    files, d = _segmented(shm)
    arena, index, _ = files.open(ARENA, INDEX, segment_bytes=SEGMENT)
    arena[5:10] = b"chunk"
    files.mark_granted()
    assert files.segments is not None
    ro = files.segments.readonly(0)
    old_reader = mmap.mmap(ro, SEGMENT, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    os.close(ro)
    listed = {os.path.basename(f.path) for f in arena_files.listing(str(d))}
    assert files.stem + ".granted" in listed
    files.close()
    arena.close()
    index.close()
    again = _files(d)
    arena, index, kept = again.open(ARENA, INDEX, segment_bytes=SEGMENT)
    assert kept and arena[5:10] == b"chunk"
    assert os.stat(again.paths[1]).st_blocks == 0                   # a hole stays one
    arena[5:10] = b"other"
    assert old_reader[5:10] == b"chunk"                             # never sees the new run
    assert not (d / (files.stem + ".granted")).exists()
    old_reader.close()
    again.close()
    arena.close()
    index.close()
