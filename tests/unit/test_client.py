"""The Python library (kspeedfs/client/) end to end without the kernel: a real source
tree imported into a real embedded store, read through ``kspeedfs.open_dataset`` and
compared byte for byte with the source; metadata against ``os``; the errors a mount's
``open()`` raises; tarfile and PIL over ``ds.open``; a second read from the memory
tier; a forked child refused; and the whole thing as uid nobody with /dev/fuse hidden."""
from __future__ import annotations

import errno
import io
import os
import random
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

import kspeedfs
from kspeedfs.config import load
from kspeedfs.manifest.importer import import_tree
from kspeedfs.manifest.store.embedded import EmbeddedStore
from tests.fixtures.mounts import CHUNK, files_below, make_tree

REPO = Path(__file__).resolve().parents[2]


def _config(store: Path, memory: str = "512MiB"):
    """A configuration of this test alone: an empty file instead of /etc's, no
    KSPEEDFS_* environment."""
    empty = store.parent / "kspeedfs.toml"
    empty.touch()
    return load(empty, overrides={"store.path": str(store), "cache.memory": memory}, environ={})


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("client")
    src = make_tree(base / "src", small_files=300)
    with tarfile.open(src / "shard-000.tar", "w") as tar:      # a WebDataset-style shard
        for i in range(20):
            data = random.Random(i).randbytes(1000 + 97 * i)
            info = tarfile.TarInfo(f"{i:06d}.jpg")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    import_tree(src, "tree", EmbeddedStore(base / "store"), CHUNK)
    return src, base / "store"


@pytest.fixture(params=["512MiB", "8MiB"], ids=["resident", "transient"])
def ds(tree, request):
    """512 MiB: everything read stays in the memory tier's resident part, and hits are
    answered in the caller's thread; 8 MiB: all of it is transient, every read goes
    through the trio thread."""
    _, store = tree
    with kspeedfs.open_dataset("tree", config=_config(store, request.param)) as d:
        yield d


def test_every_file_reads_back_exactly(tree, ds) -> None:
    src, _ = tree
    paths = files_below(src)
    for p in paths:
        want = (src / os.fsdecode(p)).read_bytes()
        assert ds.read(p) == want, p
        with ds.open(p) as f:
            assert f.read() == want, p
    many = ds.read_many(iter(paths))
    assert [len(m) for m in many] == [os.path.getsize(src / os.fsdecode(p)) for p in paths]
    assert all(m == (src / os.fsdecode(p)).read_bytes() for p, m in zip(paths, many, strict=False))


def test_ranged_reads_and_seeks_match_the_source(tree, ds) -> None:
    src, _ = tree
    want = (src / "many-chunks.bin").read_bytes()
    rnd = random.Random(7)
    with ds.open("many-chunks.bin", buffering=0) as f:
        for _ in range(200):
            off = rnd.randrange(len(want) + 10)
            n = rnd.choice((1, 4096, CHUNK - 3, 2 * CHUNK + 5))
            assert f.seek(off) == off
            buf = bytearray(n)
            got = f.readinto(buf)
            assert bytes(buf[:got]) == want[off:off + n]
            assert f.tell() == off + got
        assert f.seek(-10, os.SEEK_END) == len(want) - 10
        assert f.read() == want[-10:]
    assert ds.read("many-chunks.bin", CHUNK - 5, 10) == want[CHUNK - 5:CHUNK + 5]
    assert ds.read("many-chunks.bin", len(want) - 3, 100) == want[-3:]
    assert ds.read("empty") == b""


def test_a_tar_shard_reads_with_tarfile(tree, ds) -> None:
    src, _ = tree
    with ds.open("shard-000.tar") as f, tarfile.open(fileobj=f) as tar:
        members = tar.getmembers()
        assert [m.name for m in members] == [f"{i:06d}.jpg" for i in range(20)]
        for i, m in enumerate(members):
            assert tar.extractfile(m).read() == random.Random(i).randbytes(1000 + 97 * i)
    with ds.open("a/b/c/d/e/f/g/h/deep.txt", "r", encoding="latin-1", newline="") as t:
        assert t.read() == (src / "a/b/c/d/e/f/g/h/deep.txt").read_bytes().decode("latin-1")


def test_pil_opens_an_image_from_the_dataset(tmp_path: Path) -> None:
    Image = pytest.importorskip("PIL.Image")
    src = tmp_path / "src"
    src.mkdir()
    rnd = random.Random(9)
    img = Image.frombytes("RGB", (160, 120), rnd.randbytes(160 * 120 * 3))
    img.save(src / "x.png")
    img.save(src / "x.jpg", quality=90)
    import_tree(src, "img", EmbeddedStore(tmp_path / "store"), CHUNK)
    with kspeedfs.open_dataset("img", config=_config(tmp_path / "store")) as ds:
        for name in ("x.png", "x.jpg"):
            with ds.open(name) as f, Image.open(f) as got, Image.open(src / name) as want:
                assert got.size == (160, 120)
                assert got.tobytes() == want.tobytes()


def test_metadata_is_what_os_says_of_the_source(tree, ds) -> None:
    src, _ = tree
    for dirpath, dirs, files in ds.walk():
        real = src / dirpath
        assert sorted(dirs + files) == sorted(os.listdir(real)), dirpath
        assert ds.listdir(dirpath) == sorted(dirs + files, key=os.fsencode)
        for name in files:
            rel = f"{dirpath}/{name}" if dirpath else name
            mine, theirs = ds.stat(rel, follow_symlinks=False), os.lstat(real / name)
            assert (mine.st_mode, mine.st_size, mine.st_mtime_ns, mine.st_uid) == \
                (theirs.st_mode, theirs.st_size, theirs.st_mtime_ns, theirs.st_uid), rel
    assert ds.listdir(b"names") == sorted(os.listdir(os.fsencode(src / "names")))
    assert ds.read("names/link-to-one") == (src / "one").read_bytes()     # followed
    assert ds.stat("/names/../names/./link-to-one").st_size == 1
    assert ds.stat("").st_ino == 1 and ds.isdir("small") and ds.isfile("one")
    assert not ds.exists("names/dangling") and ds.exists("names/with space")


WRONG_PATHS = [                     # (call, the error open() on the mount raises)
    (lambda ds: ds.read("no/such/file"), FileNotFoundError),
    (lambda ds: ds.open("names/dangling"), FileNotFoundError),
    (lambda ds: ds.read("small"), IsADirectoryError),
    (lambda ds: ds.open("small"), IsADirectoryError),
    (lambda ds: ds.stat("one/x"), NotADirectoryError),
    (lambda ds: ds.listdir("one"), NotADirectoryError),
]


@pytest.mark.parametrize("call, error", WRONG_PATHS, ids=[
    "read-missing", "open-dangling", "read-dir", "open-dir", "stat-through-file", "listdir-file"])
def test_wrong_paths_raise_what_open_on_the_mount_raises(ds, call, error) -> None:
    with pytest.raises(error):
        call(ds)


def test_symlinks_stay_inside_the_dataset(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "one").write_bytes(b"1")
    os.symlink("/etc/hostname", src / "d" / "absolute")     # the host's file, not ours
    os.symlink("../../../../one", src / "d" / "up")         # .. stops at the root
    os.symlink("loop", src / "d" / "loop")
    os.symlink("../d", src / "d" / "self")
    import_tree(src, "links", EmbeddedStore(tmp_path / "store"), CHUNK)
    with kspeedfs.open_dataset("links", config=_config(tmp_path / "store")) as ds:
        with pytest.raises(FileNotFoundError):
            ds.read("d/absolute")
        assert ds.read("d/up") == b"1"
        assert ds.read("d/self/self/self/up") == b"1"
        with pytest.raises(OSError) as e:
            ds.read("d/loop")
        assert e.value.errno == errno.ELOOP
        assert stat.S_ISLNK(ds.stat("d/absolute", follow_symlinks=False).st_mode)


def test_write_modes_datasets_and_config_errors(tree, ds) -> None:
    _, store = tree
    with pytest.raises(OSError) as e:
        ds.open("one", "wb")
    assert e.value.errno == errno.EROFS
    with pytest.raises(FileNotFoundError):
        kspeedfs.open_dataset("nonesuch", config=_config(store))
    with pytest.raises(FileNotFoundError):
        kspeedfs.open_dataset("tree", version=99, config=_config(store))
    with pytest.raises(OSError) as e:
        kspeedfs.open_dataset("tree", config={"store.path": str(store), "fuse.workers": 0})
    assert e.value.errno == errno.EINVAL and "fuse.workers" in str(e.value)


def test_a_changed_source_file_is_eio_and_its_neighbours_read(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(5):
        (src / f"f{i}").write_bytes(bytes([i]) * 5000)
    import_tree(src, "ch", EmbeddedStore(tmp_path / "store"), CHUNK)
    (src / "f2").write_bytes(b"x" * 5000)            # same size, other bytes
    with kspeedfs.open_dataset("ch", config=_config(tmp_path / "store")) as ds:
        with pytest.raises(OSError) as e:
            ds.read("f2")
        assert e.value.errno == errno.EIO and type(e.value) is OSError
        assert "f2" in str(e.value.__cause__)
        assert ds.read("f3") == bytes([3]) * 5000


def test_a_second_read_comes_from_the_memory_tier(tree) -> None:
    src, store = tree
    want = (src / "many-chunks.bin").read_bytes()
    with kspeedfs.open_dataset("tree", config=_config(store)) as ds:
        assert ds.read("many-chunks.bin") == want
        before = ds.statistics()
        assert ds.read("many-chunks.bin") == want
        with ds.open("many-chunks.bin", buffering=0) as f:
            f.seek(CHUNK - 100)
            assert f.read(200) == want[CHUNK - 100:CHUNK + 100]
        after = ds.statistics()
    assert after.source_loads == before.source_loads
    assert after.memory_hits == before.memory_hits + 10 + 2
    # resident hits never reached the Reader (the trio thread): counted beside it
    assert after.python_reads == before.python_reads
    assert after.reads == before.reads + 2


def test_closed_dataset_and_files_raise_valueerror(tree) -> None:
    _, store = tree
    ds = kspeedfs.open_dataset("tree", config=_config(store))
    f = ds.open("one")
    ds.close()
    ds.close()                                        # idempotent
    assert ds.closed
    with pytest.raises(ValueError):
        ds.read("one")
    with pytest.raises(ValueError):
        f.read()
    f.close()


def test_a_forked_child_is_refused(tree, ds) -> None:
    pid = os.fork()
    if pid == 0:                                      # the child: never returns to pytest
        code = 1
        try:
            ds.read("one")
        except RuntimeError:
            code = 0
        except BaseException:
            code = 2
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert ds.read("one") == (tree[0] / "one").read_bytes()


NOBODY = """
import os, sys, kspeedfs
assert os.getuid() == 65534
try:
    os.open("/dev/fuse", os.O_RDWR)
    sys.exit("/dev/fuse opened")
except PermissionError:
    pass
with kspeedfs.open_dataset("tree", config={"store.path": sys.argv[1]}, source=sys.argv[2]) as ds:
    for p in sys.argv[3:]:
        assert ds.read(p) == open(os.path.join(sys.argv[2], p), "rb").read(), p
    print(ds.statistics().source_loads + ds.statistics().source_extents)
from kspeedfs.errors import StoreUnavailable
from kspeedfs.manifest.importer import import_tree
from kspeedfs.manifest.store.embedded import EmbeddedStore
try:                    # a reader, not a writer: an import is refused in one line
    import_tree(sys.argv[2], "tree", EmbeddedStore(sys.argv[1]), 1 << 20)
    sys.exit("imported as nobody")
except StoreUnavailable as e:
    assert "Permission denied" in str(e), e
"""


@pytest.mark.skipif(os.getuid() != 0 or not shutil.which("unshare"), reason="needs root to drop to nobody")
def test_reads_as_nobody_without_dev_fuse(tree) -> None:
    """As uid nobody, in a mount namespace where /dev/fuse is an empty file no one may
    open: the library reads the embedded store it can read, with the default
    configuration, and may not write it."""
    src, store = tree
    base = Path(tempfile.mkdtemp(prefix="kspeedfs-nobody-"))
    try:
        os.chmod(base, 0o755)
        shutil.copytree(store, base / "store")
        shutil.copytree(src, base / "src", symlinks=True)
        subprocess.run(["chmod", "-R", "a+rX", str(base)], check=True)
        # the store records the source at its path at import (unreadable to nobody): the
        # copy is read instead (source=, a mount's --source)
        rel = ["one", "many-chunks.bin", "small/d1/img00001.jpg"]
        nofuse = base / "nofuse"
        nofuse.touch(mode=0o000)
        cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
               ('mount --bind "$0" /dev/fuse && exec setpriv --reuid=65534 --regid=65534 '
                '--clear-groups "$@"'), str(nofuse), sys.executable, "-c", NOBODY,
               str(base / "store"), str(base / "src"), *rel]
        env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HOME": "/nonexistent"}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env,
                              cwd="/")
        assert proc.returncode == 0, proc.stderr
        assert int(proc.stdout.split()[-1]) > 0          # read from the source, as nobody
    finally:
        shutil.rmtree(base)


def test_a_paged_dataset_reads_alike_and_fails_closed_without_a_page(tmp_path: Path) -> None:
    from kspeedfs.manifest.index import inflate
    from kspeedfs.manifest.pages import Root, page_path, read_table

    src = tmp_path / "src"
    for d in range(20):
        (src / f"d{d:02d}").mkdir(parents=True)
        for f in range(100):
            (src / f"d{d:02d}" / f"f{f:03d}").write_bytes(b"%d" % f * 40)
    store = EmbeddedStore(tmp_path / "store")
    whole = import_tree(src, "p", store, CHUNK)
    raw = inflate(store.manifest("p", whole.version), whole.inflated_size)
    store.paged_above = 0
    paged = store.publish_stream(whole, [raw], len(raw))
    with kspeedfs.open_dataset("p", config=_config(tmp_path / "store")) as ds:
        assert ds.version == paged.version and ds.index.pages is not None
        assert ds.read("d03/f007") == (src / "d03" / "f007").read_bytes()
        assert ds.stat("d19/f099").st_size == 80
    root = Root.parse(store.manifest("p", paged.version))
    pages = str(tmp_path / "store" / "pages")
    os.unlink(page_path(pages, read_table(root, [pages])[-32:]))   # the digests' page
    with kspeedfs.open_dataset("p", config=_config(tmp_path / "store")) as ds:
        with pytest.raises(OSError) as e:
            ds.read("d19/f099")
        assert e.value.errno == errno.EIO
        with pytest.raises(OSError) as e:
            ds.stat("d00/f000")
        assert e.value.errno == errno.EIO and "unreadable" in str(e.value)
