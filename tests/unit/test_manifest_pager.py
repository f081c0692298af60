"""The page map (kspeedfs/manifest/pager.py over native/manifest_pager.c): a blob's pages
written as real page files (hashlib, zlib) into tmp dirs, read back through the mapping.

What could hang (a handler that never fills a page leaves its reader in the kernel for
good, GIL and all) fails instead: reads in a child process have a timeout, GIL-free
reads (hashlib in a daemon thread, ``read_within``) a deadline, and every test a
watchdog that needs no GIL (``deadline``).
"""
from __future__ import annotations

import ctypes
import errno
import faulthandler
import gzip
import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from kspeedfs.manifest import pager as pager_mod
from kspeedfs.manifest.pager import PageMap, page_count, page_path

_pager = pytest.importorskip("kspeedfs.manifest._pager", reason="the page map is not built")



@pytest.fixture(autouse=True)
def deadline() -> Iterator[None]:
    """A read the handler never answers blocks in the kernel, maybe with the GIL held, where
    no Python-level timeout can reach it; faulthandler's watchdog is a C thread: it dumps
    every thread's stack and exits, failing the run instead of hanging it."""
    faulthandler.dump_traceback_later(90, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()

PS = 64 << 10
REPO = Path(__file__).resolve().parents[2]


def manifest_like(size: int, seed: int = 1) -> bytes:
    """Bytes shaped like a raw blob's arrays: runs of small counters, repeated modes,
    names, and a share of random digests (so pages neither vanish under zlib nor are
    incompressible)."""
    rng = random.Random(seed)
    out = bytearray()
    n = 0
    while len(out) < size:
        kind = rng.randrange(4)
        if kind == 0:
            out += b"".join((n + k).to_bytes(8, "little") for k in range(512))
            n += 512
        elif kind == 1:
            out += (0o100644).to_bytes(4, "little") * 1024
        elif kind == 2:
            out += b"".join(b"img%08d.jpg" % (n + k) for k in range(256))
        else:
            out += rng.randbytes(2048)
    return bytes(out[:size])


def write_pages(directory: Path, data: bytes, page_size: int = PS) -> bytes:
    """Every page of ``data`` as a page file under ``directory``; the hashes, in order."""
    hashes = b""
    for off in range(0, len(data), page_size):
        page = data[off:off + page_size]
        digest = hashlib.sha256(page).digest()
        hashes += digest
        put(directory, digest, zlib.compress(page))
    return hashes


def put(directory: Path, digest: bytes, content: bytes) -> Path:
    path = Path(page_path(str(directory), digest))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return path


def digest_of(hashes: bytes, i: int) -> bytes:
    return hashes[32 * i:32 * i + 32]


def read_within(view: memoryview, seconds: float = 20.0) -> bytes:
    """SHA-256 of ``view``, read in a daemon thread (hashlib lets the GIL go while it reads),
    so a page that is never filled fails this instead of hanging the process."""
    out: list[bytes] = []
    t = threading.Thread(target=lambda: out.append(hashlib.sha256(view).digest()), daemon=True)
    t.start()
    t.join(seconds)
    assert out, f"reading {len(view)} bytes through the page map did not finish in {seconds}s"
    return out[0]


def sha(b: bytes) -> bytes:
    return hashlib.sha256(b).digest()


@pytest.fixture
def blob(tmp_path: Path) -> tuple[bytes, bytes, Path]:
    """A blob of 7.4 pages (its size a multiple of neither the page nor 4 KiB), its
    hashes and the dir holding its pages."""
    data = manifest_like(7 * PS + 25_000 + 3)
    d = tmp_path / "pages"
    return data, write_pages(d, data), d


@pytest.fixture
def opened() -> Iterator[list[PageMap]]:
    """Maps to close after the test, views or not (a failed assert may leave one)."""
    maps: list[PageMap] = []
    yield maps
    for pm in maps:
        try:
            pm.close()
        except BufferError:
            pass


def open_map(opened: list[PageMap], data: bytes, hashes: bytes, dirs: list[Path],
             cache_bytes: int = 1 << 30, threads: int = 2, page_size: int = PS) -> PageMap:
    pm = PageMap(len(data), page_size, hashes, [str(d) for d in dirs], cache_bytes, threads)
    opened.append(pm)
    return pm


def test_whole_region_reads_back_the_source_bytes(blob, opened) -> None:
    data, hashes, d = blob
    pm = open_map(opened, data, hashes, [d])
    v = pm.view()
    assert (len(v), v.format, v.readonly, v.itemsize) == (len(data), "B", True, 1)
    assert read_within(v) == sha(data)
    assert bytes(v) == data
    st = pm.stats()
    pages = page_count(len(data), PS)
    assert st["fills"] == pages and st["resident_pages"] == pages
    assert st["failures"] == 0 and st["evictions"] == 0 and st["faults"] >= pages
    assert st["fill_ns"] > 0 and st["user_mode_only"] in (0, 1)
    assert all(st[k] > 0 for k in ("read_ns", "inflate_ns", "sha_ns", "copy_ns")), st
    assert pm.failure is None
    v.release()


def test_a_view_cannot_be_written(blob, opened) -> None:
    data, hashes, d = blob
    pm = open_map(opened, data, hashes, [d])
    v = pm.view()
    with pytest.raises(TypeError):
        v[0] = 1
    with pytest.raises(TypeError):                  # a writable buffer is refused
        ctypes.c_char.from_buffer(pm.native)
    v.release()


def test_many_threads_read_random_ranges_at_once(opened) -> None:
    data = manifest_like(40 * PS + 777, seed=2)
    with tempfile.TemporaryDirectory() as tmp:
        hashes = write_pages(Path(tmp), data)
        # a cache of 8 pages: the readers' pages are dropped and loaded again under them
        pm = open_map(opened, data, hashes, [Path(tmp)], cache_bytes=8 * PS, threads=3)
        v = pm.view()
        errors: list[str] = []

        def reader(seed: int) -> None:
            rng = random.Random(seed)
            for _ in range(150):
                a = rng.randrange(len(data))
                b = min(len(data), a + rng.choice((1, 100, 5000, PS, 3 * PS)))
                if rng.random() < 0.5:     # hashlib: the GIL let go while it faults
                    ok = hashlib.sha256(v[a:b]).digest() == sha(data[a:b])
                else:                      # bytes(): the fault taken with the GIL held
                    ok = bytes(v[a:b]) == data[a:b]
                if not ok:
                    errors.append(f"[{a}:{b}]")

        threads = [threading.Thread(target=reader, args=(s,), daemon=True) for s in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "readers stuck"
        assert errors == []
        st = pm.stats()
        assert st["failures"] == 0 and pm.failure is None
        assert st["evictions"] > 0 and st["resident_pages"] <= 8
        v.release()


def test_eviction_keeps_resident_pages_within_the_cache(blob, opened) -> None:
    data, hashes, d = blob
    pm = open_map(opened, data, hashes, [d], cache_bytes=3 * PS + 100)
    v = pm.view()
    for _ in range(3):
        for off in range(0, len(data), 4096):
            assert v[off] == data[off]
            assert pm.stats()["resident_pages"] <= 3
    st = pm.stats()
    pages = page_count(len(data), PS)
    assert st["evictions"] > 0 and st["fills"] > pages
    assert st["fills"] == st["evictions"] + st["resident_pages"]
    assert bytes(v) == data                    # and right when read again
    assert pm.failure is None
    v.release()


def test_a_cache_smaller_than_a_page_keeps_one(blob, opened) -> None:
    data, hashes, d = blob
    pm = open_map(opened, data, hashes, [d], cache_bytes=100)
    v = pm.view()
    assert read_within(v) == sha(data)
    assert bytes(v[3 * PS:5 * PS + 9]) == data[3 * PS:5 * PS + 9]
    assert pm.stats()["resident_pages"] == 1
    v.release()


def test_a_missing_page_is_a_failure_naming_it_and_reads_zeros(blob, opened) -> None:
    data, hashes, d = blob
    Path(page_path(str(d), digest_of(hashes, 3))).unlink()
    pm = open_map(opened, data, hashes, [d])
    v = pm.view()
    assert bytes(v[:3 * PS]) == data[:3 * PS]
    assert pm.failure is None                  # nothing failed before page 3 was touched
    assert bytes(v[3 * PS:4 * PS]) == bytes(PS)
    failure = pm.failure                       # set before the zeros were placed: no wait
    assert failure is not None and "\n" not in failure
    assert "page 3 " in failure and digest_of(hashes, 3).hex() in failure
    assert "missing" in failure
    assert bytes(v[4 * PS:]) == data[4 * PS:]
    st = pm.stats()
    assert st["failures"] == 1 and st["fills"] == page_count(len(data), PS) - 1
    v.release()


def test_the_failure_is_sticky_and_the_first(blob, opened) -> None:
    data, hashes, d = blob
    for i in (1, 5):
        Path(page_path(str(d), digest_of(hashes, i))).unlink()
    pm = open_map(opened, data, hashes, [d], cache_bytes=PS)
    v = pm.view()
    assert v[5 * PS] == 0
    first = pm.failure
    assert first is not None and "page 5 " in first
    assert v[1 * PS] == 0 and v[0] == data[0] and v[5 * PS + 1] == 0   # page 5 again
    assert pm.failure == first
    assert pm.stats()["failures"] == 3
    v.release()


def _corrupt(kind: str, data: bytes, hashes: bytes, d: Path, i: int) -> None:
    page = data[i * PS:(i + 1) * PS]
    path = Path(page_path(str(d), digest_of(hashes, i)))
    stream = zlib.compress(page)
    content = {
        "bad zlib": b"\x78\x9c" + bytes(range(256)) * 4,
        "random bytes": random.Random(9).randbytes(3000),
        "empty": b"",
        "truncated": stream[:len(stream) // 2],
        "one byte short": zlib.compress(page[:-1]),
        "one byte long": zlib.compress(page + b"\0"),
        "trailing data": stream + b"\0",
        "another page's content": zlib.compress(data[:PS]),
        "a bit flipped": stream[:100] + bytes([stream[100] ^ 4]) + stream[101:],
        "raw, not zlib'd": page,
        "gzip, not zlib": gzip.compress(page),
        "a bomb": zlib.compress(bytes(64 << 20)),
    }.get(kind)
    path.unlink()
    if kind == "a fifo":
        os.mkfifo(path)
    elif kind == "a directory":
        path.mkdir()
    elif kind == "a symlink loop":      # open fails, and not with ENOENT
        path.symlink_to(path)
    else:
        assert content is not None
        path.write_bytes(content)


CORRUPTIONS = ["bad zlib", "random bytes", "empty", "truncated", "one byte short",
               "one byte long", "trailing data", "another page's content", "a bit flipped",
               "raw, not zlib'd", "gzip, not zlib", "a bomb", "a fifo", "a directory",
               "a symlink loop"]


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_a_corrupt_page_is_a_failure(kind: str, blob, opened) -> None:
    data, hashes, d = blob
    _corrupt(kind, data, hashes, d, 2)
    pm = open_map(opened, data, hashes, [d])
    v = pm.view()
    assert read_within(v[2 * PS:3 * PS]) == sha(bytes(PS))
    failure = pm.failure
    assert failure is not None and "page 2 " in failure, failure
    assert read_within(v[3 * PS:]) == sha(data[3 * PS:])
    assert pm.stats()["failures"] == 1
    v.release()


def test_the_second_dir_serves_what_the_first_lacks(tmp_path: Path, opened) -> None:
    data = manifest_like(6 * PS, seed=3)
    a, b = tmp_path / "a", tmp_path / "b"
    hashes = write_pages(a, data)
    write_pages(b, data)
    Path(page_path(str(a), digest_of(hashes, 1))).unlink()    # missing in a
    _corrupt("a bit flipped", data, hashes, a, 4)              # corrupt in a
    pm = open_map(opened, data, hashes, [a, b])
    v = pm.view()
    assert read_within(v) == sha(data)
    assert pm.failure is None and pm.stats()["failures"] == 0
    v.release()
    # ... and when neither has it, the failure says what each dir said
    pm2 = open_map(opened, data, hashes, [a, tmp_path / "c"])
    assert read_within(pm2.view()[PS:2 * PS]) == sha(bytes(PS))
    failure = pm2.failure
    assert failure is not None and f"{a}: missing; {tmp_path / 'c'}: missing" in failure


def test_the_main_thread_holding_the_gil_reads_the_map(blob) -> None:
    """The faulting thread holds the GIL throughout (bytes() of a view): the handler must
    fill without it. In a child, so a handler that needed the GIL fails by timeout."""
    data, hashes, d = blob
    code = f"""
import sys, threading
from kspeedfs.manifest.pager import PageMap
data = open({str(d / 'blob')!r}, 'rb').read()
pm = PageMap(len(data), {PS}, open({str(d / 'hashes')!r}, 'rb').read(), [{str(d)!r}], 1 << 30)
assert threading.current_thread() is threading.main_thread()
sys.setswitchinterval(1000)        # and no other Python thread gets the GIL meanwhile
v = pm.view()
assert bytes(v) == data, "bytes differ"
print(pm.stats()["fills"])
"""
    (d / "blob").write_bytes(data)
    (d / "hashes").write_bytes(hashes)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr
    assert int(r.stdout) == page_count(len(data), PS)


def test_close_refuses_while_a_view_lives(blob, opened) -> None:
    data, hashes, d = blob
    pm = open_map(opened, data, hashes, [d])
    v = pm.view()
    w = v[PS:2 * PS]                        # a slice holds the export too
    v.release()
    with pytest.raises(BufferError):
        pm.close()
    assert bytes(w[:10]) == data[PS:PS + 10]
    w.release()
    pm.close()
    pm.close()                              # idempotent
    assert pm.closed
    with pytest.raises(ValueError):
        pm.view()
    with pytest.raises(ValueError):
        pm.stats()


def test_a_kernel_read_of_an_untouched_page_is_served(blob, opened, tmp_path: Path) -> None:
    """write(2) from the map: the kernel's own access faults and waits for the fill (full
    mode, which root gets)."""
    data, hashes, d = blob
    pm = open_map(opened, data, hashes, [d])
    if pm.stats()["user_mode_only"]:
        pytest.skip("user-mode-only fault handling here: kernel reads get EFAULT")
    v = pm.view()
    with open(tmp_path / "out", "wb", buffering=0) as f:
        assert f.write(v[5 * PS:6 * PS + 10]) == PS + 10
    assert (tmp_path / "out").read_bytes() == data[5 * PS:6 * PS + 10]
    v.release()


def test_c_api_holds_the_map_and_reads_the_failure_flag(blob, opened) -> None:
    data, hashes, d = blob
    Path(page_path(str(d), digest_of(hashes, 0))).unlink()
    pm = open_map(opened, data, hashes, [d])

    class CAPI(ctypes.Structure):
        _fields_ = [("abi", ctypes.c_int),
                    ("hold", ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object)),
                    ("release", ctypes.PYFUNCTYPE(None, ctypes.py_object)),
                    ("failed", ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)),
                    ("failure", ctypes.CFUNCTYPE(ctypes.c_char_p, ctypes.c_void_p)),
                    ("base", ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)),
                    ("size", ctypes.CFUNCTYPE(ctypes.c_size_t, ctypes.c_void_p))]

    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    api = CAPI.from_address(get(_pager._C_API, b"kspeedfs.manifest._pager._C_API"))
    assert api.abi == 1
    m = api.hold(pm.native)
    assert m == pm.address
    with pytest.raises(BufferError):
        pm.close()
    assert api.size(m) == len(data) and api.base(m) == pm.native.base
    assert api.failed(m) == 0 and api.failure(m) is None
    assert ctypes.string_at(api.base(m) + PS, 100) == data[PS:PS + 100]
    assert api.failed(m) == 0
    assert ctypes.string_at(api.base(m), 100) == bytes(100)      # page 0: missing
    assert api.failed(m) == 1
    assert api.failure(m).decode() == pm.failure
    api.release(pm.native)
    pm.close()
    with pytest.raises(TypeError):
        api.hold(object())


def test_a_forked_child_cannot_use_the_map(blob, opened) -> None:
    data, hashes, d = blob
    pm = open_map(opened, data, hashes, [d])
    assert pm.view()[0] == data[0]
    pid = os.fork()
    if pid == 0:                                            # the child
        try:
            pm.view()
        except RuntimeError:
            pm.close()                                      # frees the child's copy only
            os._exit(0)
        os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    # the mapping itself is gone in a child (MADV_DONTFORK): a touch is SIGSEGV, never the
    # zeros of an unregistered copy (not under ASan: its SEGV handler would file a report)
    if os.environ.get("KSPEEDFS_SANITIZED"):
        return
    base = pm.native.base
    pid = os.fork()
    if pid == 0:
        faulthandler.disable()                              # the SIGSEGV is the point
        ctypes.string_at(base + 6 * PS, 1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == 11
    assert bytes(pm.view()) == data                         # the parent's map is intact


def _others_can_read(path: Path) -> bool:
    return all(p.stat().st_mode & 0o005 == 0o005 for p in (path, *path.parents))


def test_an_unprivileged_process_gets_user_mode_only_handling(blob) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to drop to uid 65534")
    if not _others_can_read(REPO):      # the sanitizer lane's copy is in a 0700 mktemp dir
        pytest.skip(f"uid 65534 cannot read {REPO}")
    data, hashes, _ = blob
    with tempfile.TemporaryDirectory() as tmp:
        top = Path(tmp)
        top.chmod(0o755)
        d = top / "pages"
        write_pages(d, data)
        for path in [d, *d.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        (top / "blob").write_bytes(data)
        (top / "hashes").write_bytes(hashes)
        (top / "blob").chmod(0o644)
        (top / "hashes").chmod(0o644)
        code = f"""
import errno, json, os
os.setgroups([]); os.setgid(65534); os.setuid(65534)
from kspeedfs.manifest.pager import PageMap
PS = {PS}
data = open({str(top / 'blob')!r}, 'rb').read()
pm = PageMap(len(data), PS, open({str(top / 'hashes')!r}, 'rb').read(), [{str(d)!r}], 1 << 30)
v = pm.view()
out = {{"same": bytes(v[:4 * PS]) == data[:4 * PS]}}
try:                                    # a kernel read of a page not yet filled
    os.write(os.memfd_create("x"), v[6 * PS:6 * PS + 10]); out["kernel"] = "ok"
except OSError as e:
    out["kernel"] = errno.errorcode[e.errno]
out["rest"] = bytes(v) == data
out.update(pm.stats()); out["failure"] = pm.failure
print(json.dumps(out))
"""
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=60, cwd="/", env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["same"] and out["rest"] and out["failure"] is None, out
    unprivileged = Path("/proc/sys/vm/unprivileged_userfaultfd").read_text().strip()
    if unprivileged == "0":
        assert out["user_mode_only"] == 1
        assert out["kernel"] == "EFAULT"
    else:
        assert out["user_mode_only"] == 0


def test_arguments_are_checked(blob) -> None:
    data, hashes, d = blob
    ok = dict(size=len(data), page_size=PS, hashes=hashes, dirs=[str(d)], cache_bytes=PS)
    for bad, err in [(dict(page_size=1000), ValueError), (dict(page_size=0), ValueError),
                     (dict(page_size=4096 * 3 // 2), ValueError),
                     (dict(hashes=hashes[:-1]), ValueError), (dict(hashes=hashes + bytes(32)), ValueError),
                     (dict(dirs=[]), ValueError), (dict(dirs=str(d)), ValueError),
                     (dict(size=0), ValueError), (dict(cache_bytes=-1), ValueError),
                     (dict(threads=0), ValueError), (dict(threads=65), ValueError)]:
        with pytest.raises(err):
            PageMap(**{**ok, **bad})  # type: ignore[arg-type]
    # the C type checks on its own too
    with pytest.raises(ValueError):
        _pager.PageMap(len(data), 1000, b"", [str(d)], PS)
    with pytest.raises(ValueError):
        _pager.PageMap(len(data), PS, hashes, [str(d)], PS, 0)
    # a page of 4 KiB (the system page) is fine, and so is a page larger than the blob
    for page_size in (4096, 1 << 20):
        small = data[:10_000]
        with tempfile.TemporaryDirectory() as tmp:
            h = write_pages(Path(tmp), small, page_size)
            pm = PageMap(len(small), page_size, h, [tmp], 0)
            v = pm.view()
            assert read_within(v) == sha(small)
            v.release()
            pm.close()


def test_not_built_is_an_oserror(monkeypatch, blob) -> None:
    data, hashes, d = blob
    monkeypatch.setattr(pager_mod, "_pager", None)
    with pytest.raises(OSError) as e:
        PageMap(len(data), PS, hashes, [str(d)], PS)
    assert e.value.errno == errno.EOPNOTSUPP


def test_fuzzed_page_files_fill_correctly_or_fail(tmp_path: Path) -> None:
    """A few hundred hostile page files: random bytes, truncations, flipped and inserted
    bytes of a valid stream, other levels and lengths. Each map either fills the page with
    its bytes (no failure) or with zeros (failure set); the handler never crashes or hangs
    (each read has a deadline)."""
    ps = 16 << 10
    rng = random.Random(1234)
    data = manifest_like(2 * ps, seed=5)
    d = tmp_path / "p"
    hashes = write_pages(d, data, ps)
    page = data[:ps]
    path = Path(page_path(str(d), hashes[:32]))
    good = zlib.compress(page)
    filled = failed = 0
    for case in range(300):
        kind = case % 6
        if kind == 0:
            content = rng.randbytes(rng.randrange(0, 3 * ps))
        elif kind == 1:
            content = good[:rng.randrange(len(good) + 1)]
        elif kind == 2:
            b = bytearray(good)
            for _ in range(rng.randrange(1, 4)):
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
            content = bytes(b)
        elif kind == 3:
            at = rng.randrange(len(good) + 1)
            content = good[:at] + rng.randbytes(rng.randrange(1, 40)) + good[at:]
        elif kind == 4:
            content = zlib.compress(page, rng.randrange(0, 10))   # valid at any level
        else:
            cut = rng.choice((ps - 1, ps + 1, ps * 2, 1))
            content = zlib.compress((page * 2)[:cut], rng.randrange(0, 10))
        path.write_bytes(content)
        pm = PageMap(len(data), ps, hashes, [str(d)], ps, threads=1 + case % 2)
        v = pm.view()
        got = read_within(v[:ps], 10)
        rest = read_within(v[ps:], 10)
        failure, st = pm.failure, pm.stats()
        v.release()
        pm.close()
        assert rest == sha(data[ps:]), f"case {case}: the other page is wrong"
        if got == sha(page):
            assert failure is None and st["failures"] == 0, f"case {case}"
            filled += 1
        else:
            assert got == sha(bytes(ps)), f"case {case}: neither the page nor zeros"
            assert failure is not None and "page 0 " in failure, f"case {case}"
            failed += 1
    assert filled >= 50 and failed >= 200, (filled, failed)


def test_page_files_are_named_by_lowercase_hex() -> None:
    digest = bytes(range(0xA0, 0xC0))
    assert page_path("/p", digest) == "/p/a0/" + "".join(f"{b:02x}" for b in digest)
