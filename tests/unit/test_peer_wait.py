"""The library's native fetch (native/peer_wait.h, ``kspeedfs.cluster._peerwait``) on a
real soft-provider pair over loopback: a reading thread READs an extent from the
"peer's arena" (the server's MR) through C and gets verified bytes, or a status that
sends it to the Python read path — a digest mismatch, no route, a READ past its wait, a
peer gone mid-read — and never wrong bytes; staging slots of abandoned READs come back."""
from __future__ import annotations

import os
import random
import threading
import time

import pytest
import xxhash

from kspeedfs.cluster.native.fetch import soft_capi
from rdma.testing import pair_factory

_pw = pytest.importorskip("kspeedfs.cluster._peerwait",
                          reason="the library's native fetch is not built")
if soft_capi() is None:
    pytest.skip("the soft engine's C API is not built", allow_module_level=True)

CHUNK = 256 << 10
WAIT = 2_000_000_000        # ns


def digest(data: bytes) -> bytes:
    return xxhash.xxh3_128_digest(data)


@pytest.fixture
def rig():
    with pair_factory("soft", "soft_lo")(mr_size=8 << 20) as p:
        p.server.mr.write(os.urandom(p.server.mr.length))
        w = _pw.PeerWait(soft_capi(), 16)
        c, s = p.client, p.server
        h = w.engine(c.ctx.engine.raw)
        for i in range(4):                  # staging slots of 64 KiB in the client's MR
            assert w.staging(c.mr.buf + i * (64 << 10), 64 << 10, [c.mr.lkey])
        w.peer(0, [(h, c.qp.qp_num, s.mr.buf, s.mr.rkey, 0)])
        for k in range(16):                 # chunk k at k * CHUNK of the peer's arena
            w.route(k, 0, k * CHUNK)
        try:
            yield w, p
        finally:
            assert w.stop(2000) == 0


def extent(p, k: int, off: int, n: int) -> bytes:
    return p.server.mr.read(n, k * CHUNK + off)


def test_a_verified_extent_comes_back_and_is_tallied(rig) -> None:
    w, p = rig
    want = extent(p, 3, 1000, 50_000)
    assert w.read(3, 1000, 50_000, digest(want), WAIT) == want
    (t,) = w.tallies()
    assert t[:2] == (0, 0) and t[2] == p.client.qp.qp_num
    assert t[3:7] == (1, 50_000, 0, 0)
    assert w.tallies() == []                # drained


def test_each_ok_read_is_a_sample_of_its_own_up_to_the_cap(rig) -> None:
    """The hedger's thresholds are the tail of READ times: each ok READ is a sample
    (peer, path, length, ns), a failed one none; C keeps the first PW_SAMPLES between
    two calls."""
    w, p = rig
    sizes = [4096, 20_000, 50_000]
    for n in sizes:
        want = extent(p, 1, 0, n)
        assert w.read(1, 0, n, digest(want), WAIT) == want
    bad = extent(p, 4, 0, 4096)
    assert w.read(4, 0, 4096, digest(bad + b"x"), WAIT) == _pw.MISMATCH
    samples = w.samples()
    assert [(s[0], s[1], s[2]) for s in samples] == [(0, 0, n) for n in sizes]
    assert all(0 < s[3] < WAIT for s in samples)
    assert w.samples() == []                # drained
    want = extent(p, 1, 0, 100)
    for _ in range(_pw.SAMPLES + 10):
        assert w.read(1, 0, 100, digest(want), WAIT) == want
    assert len(w.samples()) == _pw.SAMPLES
    assert w.tallies()[0][3] == _pw.SAMPLES + 10 + len(sizes)   # all counted


def test_a_mismatch_is_a_status_and_clears_the_route(rig) -> None:
    w, p = rig
    want = extent(p, 2, 0, 4096)
    assert w.read(2, 0, 4096, digest(want + b"x"), WAIT) == _pw.MISMATCH
    assert w.read(2, 0, 4096, digest(want), WAIT) == _pw.NO_ROUTE   # Python's path now
    w.route(2, 0, 2 * CHUNK)
    assert w.read(2, 0, 4096, digest(want), WAIT) == want
    assert [t[5] for t in w.tallies()] == [1]                    # one failed


def test_no_route_no_slot_and_bad_arguments(rig) -> None:
    w, p = rig
    w.route(5, -1, 0)
    assert w.read(5, 0, 100, bytes(16), WAIT) == _pw.NO_ROUTE
    assert w.read(1, 0, 100 << 10, bytes(16), WAIT) == _pw.BUSY      # larger than a slot
    assert w.read(99, 0, 100, bytes(16), WAIT) == 83                  # PW_BAD
    with pytest.raises(OSError):
        w.read(1, 0, 100, bytes(8), WAIT)                            # not an xxh3-128
    with pytest.raises(OSError):
        w.route(16, 0, 0)
    with pytest.raises(OSError):
        w.peer(_pw.PEERS, [])
    with pytest.raises(OSError):
        w.peer(0, [(7, 1, 0, 0, 0)])                                # no such engine


def test_late_reads_give_their_slots_back_when_their_wc_comes(rig) -> None:
    w, p = rig
    want = extent(p, 1, 0, 60_000)
    late = 0
    for _ in range(40):                     # 10x the staging slots, each abandoned at once
        w.route(1, 0, CHUNK)
        got = w.read(1, 0, 60_000, digest(want), 1)
        assert got in (want, _pw.LATE, _pw.BUSY)
        late += got == _pw.LATE
    assert late
    w.route(1, 0, CHUNK)
    end = time.monotonic() + 5
    while (got := w.read(1, 0, 60_000, digest(want), WAIT)) == _pw.BUSY:
        assert time.monotonic() < end       # the abandoned READs' WCs are still coming
        time.sleep(0.01)
    assert got == want
    time.sleep(0.2)
    for _ in range(20):                     # every slot is back
        assert w.read(1, 0, 60_000, digest(want), WAIT) == want


def test_random_reads_from_threads_never_return_wrong_bytes(rig) -> None:
    w, p = rig
    bad: list[object] = []
    done = [0]

    def reader(seed: int) -> None:
        rnd = random.Random(seed)
        for _ in range(200):
            k, n = rnd.randrange(16), rnd.randrange(1, 64 << 10)
            off = rnd.randrange(CHUNK - n)
            want = extent(p, k, off, n)
            got = w.read(k, off, n, digest(want), WAIT)
            if got == want:
                done[0] += 1
            elif got != _pw.BUSY:           # 8 threads, 4 staging slots: BUSY is Python's
                bad.append((k, off, n, got if isinstance(got, int) else len(got)))

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert bad == [] and done[0] > 400


def test_a_peer_gone_mid_read_sends_every_read_to_python(rig) -> None:
    w, p = rig
    results: list[object] = []
    go = threading.Event()

    def reader() -> None:
        want = extent(p, 4, 0, 60_000)
        go.set()
        for _ in range(300):
            w.route(4, 0, 4 * CHUNK)
            got = w.read(4, 0, 60_000, digest(want), WAIT)
            results.append(got if isinstance(got, int) else got == want)

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    go.wait()
    p.client.ctx.engine.raw.qp_reset(p.client.qp.qp_num)     # its READs flushed
    for t in threads:
        t.join()
    assert False not in results                              # no wrong bytes, ever
    statuses = {r for r in results if type(r) is int}
    # WR_FLUSH_ERR (5), the post refused, no route (another thread's READ failed): Python's
    assert statuses and statuses <= {5, _pw.POST, _pw.NO_ROUTE, _pw.LATE, _pw.BUSY}


def test_random_arguments_give_a_status_or_verified_bytes(rig) -> None:
    """The entry parses nothing off the wire; its arguments are the caller's and the
    routes Python gave: random ones (chunks and routes out of range, remote ranges past
    the peer's arena, which its engine refuses) give a status or an OSError, never a
    crash and never bytes that do not match."""
    w, p = rig
    rnd = random.Random(7)
    size = p.server.mr.length
    for _ in range(500):
        k = rnd.choice([rnd.randrange(16), rnd.randrange(1 << 64)])
        off = rnd.choice([rnd.randrange(CHUNK), rnd.randrange(1 << 64)])
        n = rnd.choice([rnd.randrange(1, 64 << 10), rnd.randrange(1 << 32)])
        if rnd.random() < 0.3:
            try:
                w.route(rnd.randrange(16), rnd.randrange(-1, 2),
                        rnd.choice([rnd.randrange(size), rnd.randrange(1 << 57)]))
            except OSError:
                pass
        real = k < 16 and off + n <= size - 15 * CHUNK
        want = digest(extent(p, k, off, n)) if real else os.urandom(16)
        try:
            got = w.read(k, off, n, want, WAIT)
        except OSError:
            assert n == 0
            continue
        if not isinstance(got, int):
            assert digest(got) == want and len(got) == n
