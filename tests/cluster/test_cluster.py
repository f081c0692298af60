"""The cluster on real test hosts: etcd + 3 nodes (two NICs each) + a client with a mount.

One cluster per module (it takes ~10 s to build). The tests run in order and build on
each other, as an operator's day would: preload, read from peers only, lose a NIC, lose
a node (re-replication), the node comes back, etcd restarts.
"""
from __future__ import annotations

import os
import random
import re
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from kspeedfs.config import parse_size
from kspeedfs.tuning import SMALL_FILE_DIVISOR
from tests.fixtures.cluster import cluster, mount_stats, verified_read, write_dataset
from tests.fixtures.mounts import daemon_pid

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces, FUSE)")


def _make_source(root: Path) -> dict[str, bytes]:
    return write_dataset(root, seed=11, files=300, classes=5, shards=2, shard_size=6 << 20)


_stats = mount_stats


def _read_all(mnt: Path, files: dict[str, bytes], uncached: bool = False) -> int:
    """Every file read whole and compared; ``uncached``: each file's page cache dropped
    first, so its READs reach the daemon (else a file read before may never)."""
    n = 0
    for rel, want in files.items():
        with open(mnt / rel, "rb") as f:
            if uncached:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            got = f.read()
        assert got == want, f"{rel}: wrong bytes"
        n += len(got)
    return n


class Reading:
    """A background reader: reads random files through a mount until stopped, checking
    every byte; records errors and the longest gap between completed reads."""

    def __init__(self, mnt: Path, files: dict[str, bytes]) -> None:
        self.mnt, self.files = mnt, files
        self.errors: list[str] = []
        self.reads = 0
        self.max_gap = 0.0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        rels = list(self.files)
        rnd = random.Random(5)
        last = time.monotonic()
        while not self._stop.is_set():
            rel = rnd.choice(rels)
            off = rnd.randrange(0, max(1, len(self.files[rel]) - 4096))
            if (err := verified_read(self.mnt, self.files, rel, off)) is not None:
                self.errors.append(err)
            now = time.monotonic()
            self.max_gap = max(self.max_gap, now - last)
            last = now
            self.reads += 1

    def __enter__(self) -> Reading:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join(30)


def _nic_cut(c, node: int, *, lead: float, cut: float, tail: float = 1.0) -> None:
    """After ``lead`` s, node ``node``'s rail-1 NIC down for ``cut`` s, then ``tail`` s."""
    time.sleep(lead)
    c.node_host(node).nic_down(1)
    time.sleep(cut)
    c.node_host(node).nic_up(1)
    time.sleep(tail)


_SMALL: dict[int, Path] = {}


def _small_mount(c) -> Path:
    """The module's mount with a memory tier smaller than the dataset (8 MiB: 32 chunks),
    made once: re-read chunks are evicted ones, which the native fetch READs again. The
    dataset is preloaded first (a no-op after the module's first test): the native fetch
    READs only chunks a node's index says it holds, and a test selected alone (``-k``)
    otherwise found the nodes holding only what earlier reads had asked them to load (the
    small-file test: 32 of 75 files answered in C, the rest loaded through Python)."""
    if id(c) not in _SMALL:
        c.ks(["preload", "imgs", "--timeout", "60"])
        _SMALL[id(c)] = c.mount("imgs", "--cache-mem", "8MiB")
    return _SMALL[id(c)]


class Streaming(Reading):
    """A background streamer: reads the shards whole, again and again, checking every
    byte and dropping their pages after each read so the next pass asks the mount (the
    way the native fetch is exercised: whole chunks, read again once evicted)."""

    def _run(self) -> None:
        shards = [rel for rel in self.files if rel.startswith("shards/")]
        last = time.monotonic()
        while not self._stop.is_set():
            for rel in shards:
                with open(self.mnt / rel, "rb") as f:
                    if f.read() != self.files[rel]:
                        self.errors.append(f"{rel}: wrong bytes")
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                now = time.monotonic()
                self.max_gap = max(self.max_gap, now - last)
                last = now
                self.reads += 1


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("cluster")
    src = base / "source"
    files = _make_source(src)
    with cluster(base / "c", secure=True) as c:        # etcd with TLS and auth, as in production
        c.ks(["import", str(src), "--name", "imgs", "--chunk-size", c.chunk_size, "-q"])
        yield c, src, files


def test_preload_then_reads_come_from_peers(world) -> None:
    c, src, files = world
    r = c.ks(["preload", "imgs", "--timeout", "60"])
    assert "complete" in r.stdout
    check = c.ks(["preload", "imgs", "--check"])
    assert "every chunk has R verified copies" in check.stdout
    # the source is not needed any more: hide it, mount, read everything
    hidden = src.with_name("source-hidden")
    src.rename(hidden)
    try:
        mnt = c.mount("imgs", "--source", str(src))
        total = _read_all(mnt, files)
        s = _stats(mnt)
        assert s["source_loads"] == 0 and s["peer_bytes"] >= total * 0.9
        assert s["peer_hits"] > 0 and len(s["per_peer_bytes"]) == 3, s["per_peer_bytes"]
        # a fresh mount's first pass: the nodes' indexes READ whole give the native
        # fetch its routes (Peers._index_slot), so C READs chunks already
        # (whether C or Python's prefetcher starts a chunk of this first pass is timing:
        # C's own starts are asserted on the streams of the next test)
        assert s["fetch_landed"] > 0, s
        # random 4 KiB reads on a fresh mount: one block READ each, not a chunk
        fresh = c.mount("imgs", "--source", str(src))
        shard = files["shards/s0.bin"]
        with open(fresh / "shards/s0.bin", "rb") as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
            for off in (5 << 20, 3 << 20 | 77_000, 1 << 20 | 200_000):
                assert os.pread(f.fileno(), 4096, off) == shard[off:off + 4096]
        s = _stats(fresh)
        assert s["block_reads"] == 3 and s["source_blocks"] == 0 and s["source_loads"] == 0, s
        assert s["peer_bytes"] <= 3 * (128 << 10), s
    finally:
        hidden.rename(src)
    status = c.ks(["status"]).stdout
    assert "3 live node(s)" in status
    assert re.search(r"^imgs@1\s+0\s+100\.0%.*2\.00/2", status, re.M), status
    assert "etcd auth is off" not in c.log_text()      # the nodes did authenticate, over TLS


def test_nic_down_during_reads_is_invisible(world) -> None:
    c, _, files = world
    mnt = c.mounts[0]
    before = _stats(mnt)
    with Reading(mnt, files) as rd:
        _nic_cut(c, 1, lead=1.0, cut=2.0)
    assert rd.errors == [] and rd.reads > 50
    after = _stats(mnt)
    assert after["source_loads"] == before["source_loads"]
    assert after["source_blocks"] == before["source_blocks"]
    print(f"NIC down: {rd.reads} reads, longest gap between reads {rd.max_gap * 1e3:.0f} ms")


def test_chunks_read_again_are_fetched_verified_and_answered_in_c(world) -> None:
    """The native fetch (cluster/native/fetch.py): a mount whose memory tier holds 32 of
    the dataset's chunks streams the shards again and again; from the second pass its
    replicas' slots are known, so C READs, verifies and answers the chunks (two streams
    of the same files, so READs also wait in C for a chunk the other asked for; a READ
    spans several of these 256 KiB chunks, and waits for each one in flight). Every
    byte checks, also while one node's NIC is down (its READs fail over to Python's
    path) and while another is stopped (they are hedged), and nothing is read from the
    source."""
    c, _, files = world
    mnt = _small_mount(c)
    before = _stats(mnt)
    with Streaming(mnt, files) as st, Streaming(mnt, files) as st2:   # two: READs park
        _nic_cut(c, 2, lead=3.0, cut=1.5)
        c.procs["n3"].stopped_for(1.0)  # READs from n3 hang: hedged, the parked answered
        time.sleep(1.0)
    s = _stats(mnt)
    assert st.errors == st2.errors == [] and st.reads >= 8, (st.errors[:5], st.reads)
    assert s["fetch_landed"] > s["fetch_failed"] and s["fetch_landed"] >= st.reads, s
    # (a READ over several chunks in flight waits for each: parked once per chunk, ≤ 5
    # for a 1 MiB READ over 256 KiB chunks)
    assert 0 < s["fetch_parked"] == s["fetch_answered"] <= s["read_misses"] * 5, s
    assert s["source_loads"] == before["source_loads"], s
    # C starts chunks of the sequential streams itself, from the routes Python gives it
    # for the chunks after each one it starts (fuse_fetch.h): about half of them here
    started = s["fetch_started"] - before["fetch_started"]
    assert started * 5 > s["fetch_posted"] - before["fetch_posted"], (started, s)
    print(f"native fetch: {s['fetch_landed']} chunks landed, {s['fetch_failed']} stepped "
          f"aside, {s['fetch_redundant']} landed after a hedge won, {s['fetch_parked']} "
          f"READs parked, {started} started by C; {st.reads} shard reads, 0 errors")


def test_small_files_from_peers_are_fetched_verified_and_answered_in_c(world) -> None:
    """A mount whose tier is smaller than the dataset reads a small file alone (its one
    extent): the native fetch READs the extent, verifies it, puts a copy in the tier and
    answers the READ Python handed it, in C (Python routes it and adopts the copy); once
    Python has routed a chunk, the READ of another small file in it never reaches Python:
    C starts its extent itself. Only the small files are read, so no neighbour's chunk
    load brings theirs in."""
    c, _, files = world
    mnt = _small_mount(c)
    limit = parse_size(c.chunk_size) // SMALL_FILE_DIVISOR        # ReadPolicy.small_file
    small = {rel: b for rel, b in files.items() if len(b) <= limit}
    before = _stats(mnt)
    for rel, want in small.items():
        with open(mnt / rel, "rb") as f:
            assert f.read() == want, f"{rel}: wrong bytes"
    s = _stats(mnt)
    answered = s["fetch_answered"] - before["fetch_answered"]
    # (a file across a chunk boundary is not read alone; the first READs of a node
    # wait for its index copy)
    assert len(small) >= 20 and answered >= len(small) * 0.6, (len(small), answered, s)
    assert s["fetch_parked"] == s["fetch_answered"], s
    assert s["source_loads"] == before["source_loads"], s
    assert s["source_extents"] == before["source_extents"], s
    # (2-3 small files share a chunk here: the first read of each goes to Python)
    started = s["fetch_started_parts"] - before["fetch_started_parts"]
    assert started >= 3, (started, s)
    print(f"small files from peers: {len(small)} read, {answered} READs answered in C, "
          f"{started} extents started by C")


def test_small_files_c_does_not_keep_are_answered_verified_and_tallied(world) -> None:
    """With no room in the tier's resident part (the small mount's 8 MiB is all LRU), C
    answers a small file's READs from the staging slot its extent landed in, keeps
    nothing and sends Python a tally: every file's bytes right, twice (its page cache
    dropped, so the second pass READs from a peer again), each extent counted as a peer
    hit, no READ left parked, nothing from the source."""
    c, _, files = world
    mnt = _small_mount(c)
    limit = parse_size(c.chunk_size) // SMALL_FILE_DIVISOR        # ReadPolicy.small_file
    small = {rel: b for rel, b in files.items() if len(b) <= limit}
    _read_all(mnt, small, uncached=True)                 # (the tier's first puts)
    time.sleep(0.2)
    before = _stats(mnt)
    assert _read_all(mnt, small, uncached=True) == sum(map(len, small.values()))
    time.sleep(0.2)                                      # (a tally waits ≤ 5 ms in C)
    s = _stats(mnt)
    unkept = s["fetch_unkept"] - before["fetch_unkept"]
    # what the first pass kept is in the tier still (the extents Python posted: the first
    # small file of each chunk); the extents C started are all answered and not kept,
    # but for one reported LATE on a busy machine (kept: Python has a record of it)
    started = s["fetch_started_parts"] - before["fetch_started_parts"]
    assert started >= 10 and unkept >= started * 0.8, (len(small), started, unkept, s)
    assert s["peer_hits"] - before["peer_hits"] >= unkept, s
    assert s["fetch_parked"] == s["fetch_answered"], s
    assert s["source_loads"] == before["source_loads"], s
    assert s["source_extents"] == before["source_extents"], s
    print(f"small files not kept: {len(small)} read, {unkept} answered from staging slots")


def test_random_reads_from_peers_are_fetched_as_blocks_and_answered_in_c(world) -> None:
    """A random 4 KiB read of a chunk no tier holds loads one block (``_part``'s rule): on
    the native engine the block is READ from a peer, verified (xxh3-64), put in the tier
    and the READ answered in C, as a small file's extent is."""
    c, _, files = world
    mnt = _small_mount(c)
    rnd = random.Random(23)
    before = _stats(mnt)
    n = 0
    for rel in ("shards/s0.bin", "shards/s1.bin"):
        want = files[rel]
        with open(mnt / rel, "rb") as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
            for _ in range(20):
                off = rnd.randrange(0, len(want) - 4096) & ~4095
                assert os.pread(f.fileno(), 4096, off) == want[off:off + 4096], (rel, off)
                n += 1
    s = _stats(mnt)
    answered = s["fetch_answered"] - before["fetch_answered"]
    # blocks Python handed to C, and those C started itself in chunks already routed
    blocks = (s["block_reads"] - before["block_reads"]
              + s["fetch_started_parts"] - before["fetch_started_parts"])
    # (a read of a chunk the tier holds, or one loading, is answered from it instead)
    assert blocks >= 5 and answered >= blocks * 0.8, (n, blocks, answered, s)
    assert s["fetch_parked"] == s["fetch_answered"], s
    assert s["source_loads"] == before["source_loads"], s
    print(f"random reads from peers: {n} read, {blocks} as blocks, {answered} answered in C")


def test_random_reads_in_a_routed_chunk_start_their_blocks_in_c(world) -> None:
    """Once Python has handed a chunk's first random miss to C (and so routed the chunk:
    the dataset outgrows the tier, so no chunk is promoted), the next random READs in
    other blocks of that chunk start their block in C (fuse_read.c ``start_block``) and
    never reach Python: C-started parts grow, Python's block count does not. Kept (a
    block always is), they are told to Python in tallies, not by a FETCHED each, though
    this tier has no resident room and C keeps no extent."""
    c, _, files = world
    mnt = _small_mount(c)
    rel = "shards/s1.bin"
    want = files[rel]
    chunk = 256 << 10                         # (the module's import.chunk_size)
    with open(mnt / rel, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        firsts = [k * chunk + 8192 for k in range(len(want) // chunk)]
        for off in firsts:                    # each chunk's first miss: Python's
            assert os.pread(f.fileno(), 4096, off) == want[off:off + 4096], off
        before = _stats(mnt)
        for off in firsts:                    # another block of each: C's
            off += 128 << 10
            assert os.pread(f.fileno(), 4096, off) == want[off:off + 4096], off
    s = _stats(mnt)
    started = s["fetch_started_parts"] - before["fetch_started_parts"]
    python = s["python_reads"] - before["python_reads"]
    hits = s["memory_hits"] - before["memory_hits"]        # (blocks earlier tests loaded)
    assert started >= 1 and python <= len(firsts) * 0.2, (started, python, hits, s)
    assert started + hits >= len(firsts), (started, python, hits, s)
    # (one that came LATE, or found the tally full, has a FETCHED of its own)
    tallied = s["fetch_tallied"] - before["fetch_tallied"]
    assert tallied >= started * 0.8, (started, tallied, s)
    print(f"random reads in routed chunks: {len(firsts)} read, {started} blocks started in C "
          f"({tallied} told in tallies), {hits} hits, {python} in Python")


def test_sequential_reads_that_miss_wait_in_c_for_their_chunks(world) -> None:
    """A sequential READ whose chunks are neither held nor in flight (here no prefetch
    starts them: ``fuse.prefetch_chunks=0``) is not answered in Python: its chunks'
    native fetches start, and the READ waits for them in C (``Reader.hand_off``,
    ``TierChain.hand_chunks``), answered there when they land. (Answered in Python, each
    such READ had a trio task and a reply from Python: 19 % of the trio thread in the
    bench's 4-reader peer loop.)"""
    c, _, files = world
    mnt = c.mount("imgs", "--cache-mem", "8MiB", "--set", "fuse.prefetch_chunks=0")

    def read(rel: str) -> None:
        with open(mnt / rel, "rb") as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            assert f.read() == files[rel], f"{rel}: wrong bytes"

    for rel in ("shards/s0.bin", "shards/s1.bin"):  # the replicas' slots known after
        read(rel)
    before = _stats(mnt)
    read("shards/s0.bin")           # its chunks evicted by s1's: every READ misses
    s = _stats(mnt)
    misses = s["read_misses"] - before["read_misses"]
    parked = s["fetch_parked"] - before["fetch_parked"]
    late = s["late_hits"] - before["late_hits"]
    in_python = s["python_reads"] - before["python_reads"]
    # A miss is answered in C: parked on its chunks or, when chunks C started for the
    # READs before it landed while it sat in the queue, from the tier at once
    # (``read_or_park``: a late hit; a loaded machine's slower trio thread sees more of
    # those, up to all of them: CI had 4 misses and 2 parks, a run here 4 and 0).
    assert misses >= 4 and parked + late + in_python >= misses, (misses, parked, late, in_python)
    # Python answers at most one (a chunk the native fetch declined: e.g. landing slots
    # all held by chunks not yet adopted) — unless a peer READ overran its hedging
    # threshold meanwhile: C then leaves that peer's chunks to Python's hedged
    # read (``NativeFetch._start``: a node with a READ overdue), and ``read_or_park``
    # declined READs right after an overrun in a run here beside 4 busy loops. CI's
    # loaded machine saw it once: 6 misses, 3 parked, 3 late hits, 3 in Python.
    # A clean run here also saw 3 of 6 in Python with no overrun counted (a landing slot
    # not yet adopted, twice over): at most half, which answering them all in Python fails.
    overran = sum(s[k] - before[k] for k in ("peer_hedges", "peer_hedges_refused"))
    if not overran:
        assert in_python <= max(1, misses // 2), (misses, parked, late, in_python)
    assert s["fetch_parked"] == s["fetch_answered"], s
    assert s["source_loads"] == before["source_loads"], s
    print(f"sequential misses from peers: {misses} READs, {parked} waited in C, {late} "
          f"answered in C once landed, {in_python} answered in Python; {overran} peer READs "
          f"overran meanwhile")


@pytest.mark.parametrize("rail", [0, 1])
def test_fresh_mount_with_a_silent_client_nic_reads_from_peers(world, rail: int) -> None:
    """A fresh mount (no connection to any peer yet) whose NIC on one rail silently drops
    everything: it dials every NIC of each peer at once, so the live rail connects and no
    read goes to the source. (Dialled in turn, an unanswered first address ate the whole
    connect budget: every peer was skipped and the chunks came from the source.)"""
    c, _, files = world
    c.client.drop(rail)
    try:
        mnt = c.mount("imgs")
        t0 = time.monotonic()
        total = _read_all(mnt, files)
        took = time.monotonic() - t0
    finally:
        c.client.undrop(rail)
    s = _stats(mnt)
    assert s["source_loads"] == 0 and s["peer_unreachable"] == 0, s
    assert s["peer_bytes"] >= total * 0.9
    print(f"client NIC eth{rail} silent from the start: {total / took / 1e6:.0f} MB/s, all from peers")


_ATTACK = """
import socket, struct, sys, time
host, ports = sys.argv[1], [int(p) for p in sys.argv[2:]]
deep = b"[" * 1100 + b"]" * 1100
socks = []
def conn():
    try:
        socks.append(socket.create_connection((host, port), timeout=2))
        return socks[-1]
    except OSError:
        return None
for port in ports:
    for _ in range(3):                                   # the nested frame, pre-auth
        s = conn()
        s and s.sendall(struct.pack(">I", len(deep)) + deep)
    for _ in range(50):                                  # a 1 MiB - 1 frame, half sent
        s = conn()
        s and s.sendall(struct.pack(">I", (1 << 20) - 1) + b"x" * 4000)
    for _ in range(200):                                 # idle
        conn()
time.sleep(3)
print(len(socks))
"""


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


_TCP_STATES = {1: "ESTABLISHED", 2: "SYN_SENT", 3: "SYN_RECV", 4: "FIN_WAIT1", 5: "FIN_WAIT2",
               6: "TIME_WAIT", 7: "CLOSE", 8: "CLOSE_WAIT", 9: "LAST_ACK", 10: "LISTEN",
               11: "CLOSING"}


def _fd_kinds(pid: int) -> Counter[str]:
    """What a process's fds are, counted: ``tcp <local port> -> <remote> <state>`` for its
    TCP sockets (from its network namespace's /proc/<pid>/net/tcp), else the link's kind
    (``anon_inode:[eventfd]``, ``/dev/shm/...``): what a failed fd check prints."""
    tcp = {}
    with open(f"/proc/{pid}/net/tcp") as f:
        for line in list(f)[1:]:
            _, local, remote, st, *rest = line.split()
            rip, rport = remote.split(":")
            ip = ".".join(str(int(rip[i:i + 2], 16)) for i in (6, 4, 2, 0))
            tcp[rest[5]] = (f"tcp :{int(local.split(':')[1], 16)} -> {ip}:{int(rport, 16)} "
                            f"{_TCP_STATES.get(int(st, 16), st)}")
    kinds: Counter[str] = Counter()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            kinds[tcp.get(link[len("socket:["):-1], "socket (not TCP/IPv4)")] += 1
        elif link.startswith("pipe:["):
            kinds["pipe"] += 1
        else:                                    # a path, anon_inode:[eventfd], ...
            kinds[link] += 1
    return kinds


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


def test_hostile_frames_and_floods_leave_a_node_serving(world) -> None:
    """Hostile input, end to end on a real ``kspeedfs node``: from the client host, the nested
    JSON frame, half-sent 1 MiB frames and 200 idle connections against the node's vRDMA
    and RPC ports, without the secret. The node keeps serving (reads through the mount,
    ``status``), and its fd count and RSS return to where they were."""
    c, _, files = world
    node = c.procs["n1"]
    for mnt in c.mounts:       # every mount's vQP to n1 up before the baseline: in CI the
        _read_all(mnt, files)  # node once gained 3 eventfds and 5+ sockets of a vQP to the
    time.sleep(0.5)            # client host during the flood (pytest cut the rest short)
    fds0, rss0, kinds0 = _fds(node.pid), _rss(node.pid), _fd_kinds(node.pid)
    rec = c.nodes()["n1"]
    r = c.client.run([sys.executable, "-c", _ATTACK, c.node_host(1).address(1),
                      str(rec["port"]), str(rec["rpc_port"])], timeout=60)
    assert int(r.stdout.split()[-1]) > 0, (r.stdout, r.stderr)
    assert node.poll() is None, "the node died"
    deadline = time.monotonic() + 10
    while _fds(node.pid) > fds0 + 8 and time.monotonic() < deadline:
        time.sleep(0.2)
    kinds = _fd_kinds(node.pid)
    if _fds(node.pid) > fds0 + 8:      # all of it (an assertion message is cut short)
        print("fds more:", sorted((kinds - kinds0).items()), "fewer:",
              sorted((kinds0 - kinds).items()))
    assert _fds(node.pid) <= fds0 + 8, (fds0, _fds(node.pid))
    assert _rss(node.pid) < rss0 + (64 << 20), (rss0, _rss(node.pid))
    assert _read_all(c.mount("imgs"), files) > 0       # a fresh mount: new connections
    assert len(c.nodes()) == 3, (sorted(c.nodes()), c.log_text()[-3000:])


LEASE_TTL = 5        # cluster.lease_ttl, the default the cluster runs with


def _cut_costs_nothing(c, mnt: Path, files: dict[str, bytes], cut, heal, what: str,
                       seconds: float = 2 * LEASE_TTL) -> None:
    """Cut something for ``seconds`` (default 2 x the lease TTL) while a reader verifies
    every byte; then the membership never changed, nothing was re-replicated or read
    from the source, and no process printed a traceback."""
    mark = c.output_mark()
    before = _stats(mnt)
    seen: set[int] = set()
    with Reading(mnt, files) as rd:
        cut()
        try:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                seen.add(len(c.nodes()))
                time.sleep(1.0)
        finally:
            heal()
        time.sleep(1.0)
    new = c.output_since(mark)
    assert rd.errors == [] and rd.reads > 20, (what, rd.errors[:5], rd.reads)
    assert seen == {3}, f"{what}: live node counts seen {seen}"
    assert "; left " not in new and "re-replication" not in new, (what, new[-2000:])
    assert "Traceback" not in new, (what, new[-3000:])
    after = _stats(mnt)
    assert after["source_loads"] == before["source_loads"], what
    print(f"{what} for {seconds:g} s: membership unchanged, 0 chunks re-replicated, "
          f"{rd.reads} verified reads, longest gap {rd.max_gap * 1e3:.0f} ms")


def test_a_cut_nic_or_rail_never_drops_a_healthy_node(world) -> None:
    """The NIC that carries a node's etcd session (rail 1: the first etcd
    address, every node's preferred one) silently dropping everything on two nodes, and
    the other rail's NIC on the third, for 2 x TTL; then a whole rail's switch down.
    Before the fix the lease lapsed 4.5 s into such a cut and the survivors re-copied
    the node's share; with the old client (each request waiting the whole 5 s
    etcd_timeout on one endpoint) this test sees a node leave during the rail cut."""
    c, _, files = world
    mnt = c.mounts[0]
    cuts = [(1, 1), (2, 1), (3, 2)]               # (node, rail)

    def cut_nics() -> None:
        for i, rail in cuts:
            c.node_host(i).drop(rail)

    def heal_nics() -> None:
        for i, rail in cuts:
            c.node_host(i).undrop(rail)

    _cut_costs_nothing(c, mnt, files, cut_nics, heal_nics, "etcd-session NICs cut")

    def cut_rail() -> None:
        c.bed.rail_down(1)
        assert not c.client.ping(c.etcd_host.address(1)), "the rail is not cut"

    _cut_costs_nothing(c, mnt, files, cut_rail, lambda: c.bed.rail_up(1), "rail 1 down")


@pytest.mark.slow
def test_a_rail_down_for_a_minute_drops_nobody(world) -> None:
    """How long a healthy node survives with one rail down: it should be unbounded;
    12 x TTL here (the default lane cuts for 2 x TTL)."""
    c, _, files = world
    mnt = c.mounts[0] if c.mounts else c.mount("imgs")     # run alone (-m slow): its own
    _cut_costs_nothing(c, mnt, files, lambda: c.bed.rail_down(2),
                       lambda: c.bed.rail_up(2), "rail 2 down", seconds=12 * LEASE_TTL)


def test_node_killed_reads_fail_over_and_rereplicate(world) -> None:
    c, _, files = world
    mnt = c.mount("imgs")                    # fresh mount: empty memory tier
    small = _small_mount(c)
    landed = _stats(small)["fetch_landed"]
    with Reading(mnt, files) as rd, Streaming(small, files) as st:
        time.sleep(1.0)
        c.kill_node(2)
        time.sleep(3.0)
    assert rd.errors == [], rd.errors[:5]
    assert st.errors == [] and st.reads > 0, st.errors[:5]
    assert _stats(small)["fetch_landed"] > landed
    print(f"node killed, native fetch: {st.reads} shard reads, longest gap "
          f"{st.max_gap * 1e3:.0f} ms")
    s = _stats(mnt)
    print(f"node killed: {rd.reads} reads, longest gap {rd.max_gap * 1e3:.0f} ms, "
          f"longest replica stall {s['peer_longest_stall_ms']} ms")
    assert rd.max_gap < 2.0
    # the lease expires, the survivors copy n2's share from the remaining replicas
    c.wait_nodes(2, timeout=30)
    deadline = time.monotonic() + 60
    while c.ks(["preload", "imgs", "--check"], check=False).returncode != 0:
        assert time.monotonic() < deadline, c.ks(["preload", "imgs", "--check"], check=False).stdout
        time.sleep(1)
    assert "re-replication" in c.log_text()
    # the survivors read n2's share from the remaining replicas: their READ latencies
    # (and hedges) show in `kspeedfs status`, published every 2 s
    deadline = time.monotonic() + 15
    while "peer READs: hedged" not in (out := c.ks(["status"]).stdout):
        assert time.monotonic() < deadline, out
        time.sleep(1)
    print(next(line for line in out.splitlines() if "peer READs" in line))


def test_node_rejoins_and_takes_its_share_back(world) -> None:
    c, _, _ = world
    c.start_node(2)
    c.wait_nodes(3)
    deadline = time.monotonic() + 60
    while True:
        r = c.ks(["preload", "imgs", "--check"], check=False)
        if r.returncode == 0 and "n2" in r.stdout:
            break
        assert time.monotonic() < deadline, r.stdout
        time.sleep(1)


def _node_log_since(c, name: str, offset: int) -> str:
    return (c.logs / f"node-{name}.log").read_bytes()[offset:].decode(errors="replace")


def _wait_log(c, name: str, offset: int, pattern: str, timeout: float = 30) -> re.Match[str]:
    deadline = time.monotonic() + timeout
    while not (m := re.search(pattern, _node_log_since(c, name, offset))):
        assert time.monotonic() < deadline, _node_log_since(c, name, offset)[-3000:]
        time.sleep(0.2)
    return m


def test_node_restart_keeps_its_arena(world) -> None:
    """A node SIGKILLed and started again re-adopts the chunks in its arena (files in
    ``cluster.arena_dir``) after verifying each one: it reloads nothing, and readers
    meanwhile read the other replicas. A slot changed while the node was down fails its
    checksum at adoption: dropped and reloaded, never served."""
    from kspeedfs.cluster.arena import ENTRY

    c, _, files = world
    mnt = c.mount("imgs")
    log = c.logs / "node-n2.log"
    mark = log.stat().st_size
    with Reading(mnt, files) as rd:
        time.sleep(0.5)
        c.kill_node(2)
        t0 = time.monotonic()
        c.start_node(2)                                   # until it says "ready"
        ready = time.monotonic() - t0
        kept = int(_wait_log(c, "n2", mark, r"arena: (\d+) chunks kept from the last run "
                                           r"\(0 dropped")[1])
        c.wait_nodes(3)
        time.sleep(1.0)
    assert rd.errors == [], rd.errors[:5]
    assert kept > 0
    assert "chunks missing" not in _node_log_since(c, "n2", mark)    # nothing reloaded
    print(f"node restart: ready in {ready:.1f}s with {kept} chunks kept; readers: {rd.reads} "
          f"reads, longest gap {rd.max_gap * 1e3:.0f} ms")

    # corrupt one held chunk while the node is down
    c.kill_node(2)
    index = next(c.arena_dir.glob("*-n2.index")).read_bytes()
    slot_size = 256 << 10
    assert c.chunk_size == "256KiB"
    slot = next(slot for _, slot, length, _ in ENTRY.iter_unpack(index) if length)
    per = (64 << 20) // slot_size                  # slots a segment (cluster.segment_bytes)
    arena_file = next(c.arena_dir.glob(f"*-n2.arena.{slot // per}"))
    with open(arena_file, "r+b") as f:
        f.seek(slot % per * slot_size + 100)
        b = f.read(1)
        f.seek(slot % per * slot_size + 100)
        f.write(bytes([b[0] ^ 0xFF]))
    mark = log.stat().st_size
    c.start_node(2)
    _wait_log(c, "n2", mark, r"arena: \d+ chunks kept from the last run \(1 dropped")
    _wait_log(c, "n2", mark, r"1 of my \d+ chunks missing")
    _wait_log(c, "n2", mark, r"my share is cached")
    assert c.ks(["preload", "imgs", "--check"], check=False).returncode == 0


def test_etcd_restart_reads_continue(world) -> None:
    """A 10 s etcd outage: the reads go on from the last known membership, no process
    prints a traceback (the etcd client's errors are classified), and none dies (a
    crash in native code leaves faulthandler's "Fatal Python error" in its log: Debian's
    gRPC 1.51 did that now and then, etcd_client.py). A dataset no node has opened yet
    is read from its source meanwhile, without waiting for etcd per chunk (its owners
    cannot fetch its manifest: they refuse at once, share.py ``Share.dataset``; before,
    each chunk waited etcd_timeout, 5 s, per owner). A mount's daemon SIGKILLed during
    the outage is resumed from its supervisor's copy of the manifest and reads from the
    peers its predecessor knew (the node list it kept: membership.py ``keep``), not from
    the source (every file again in 1.5 s here; 6.5 s while a resume waited the usual
    etcd_timeout + 1 s for the node list; before the copy, no new daemon could load the
    manifest and the readers waited until the supervisor gave up)."""
    c, src, files = world
    c.ks(["preload", "imgs", "--timeout", "60"])     # the nodes hold it (a no-op in order)
    mnt = c.mount("imgs")
    fresh = write_dataset(src.parent / "fresh", seed=12, files=12, classes=2, shards=1,
                          shard_size=2 << 20)
    c.ks(["import", str(src.parent / "fresh"), "--name", "fresh", "--chunk-size",
          c.chunk_size, "-q"])
    mnt_fresh = c.mount("fresh")
    mark = c.output_mark()
    c.stop_etcd()
    t0 = time.monotonic()
    assert _read_all(mnt, files) > 0          # last known membership serves the reads
    time.sleep(max(0.0, 10 - (time.monotonic() - t0)))
    t1 = time.monotonic()
    assert _read_all(mnt_fresh, fresh) > 0
    took = time.monotonic() - t1
    assert took < 5, f"{took:.1f} s to read {len(fresh)} files of a dataset new to the nodes"
    print(f"etcd down: {len(fresh)} files of a dataset new to the nodes read in {took:.2f} s")
    # a mount's daemon crashes meanwhile: the one its supervisor starts loads the manifest
    # from the supervisor's sealed copy (etcd is down) and serves the reads
    pid = daemon_pid(mnt)
    t2 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    assert _read_all(mnt, files, uncached=True) > 0
    resumed = time.monotonic() - t2
    assert daemon_pid(mnt) not in (pid, None) and resumed < 10, resumed
    after = _stats(mnt)             # the new daemon's reads came from the kept peers
    assert after["source_loads"] == 0 and after["peer_hits"] > 0, after
    print(f"etcd down: a mount's daemon SIGKILLed, resumed, every file read in {resumed:.1f} s")
    c.start_etcd()
    c.wait_nodes(3, timeout=30)
    assert _read_all(mnt, files) > 0
    new = c.output_since(mark)
    assert "Traceback" not in new and "Fatal Python error" not in new, new[-3000:]
