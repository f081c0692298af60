"""Cluster workloads: the soft RDMA transport against plain TCP, and reads served by peers.

Everything here runs on netns test hosts (``tests/fixtures/netns.py``: veth pairs on two
rails, addresses in 198.18.0.0/15, no route out), so nothing leaves the machine:

* ``transport``: ``rdma.perf`` READ bandwidth of the soft provider against one plain TCP
  stream between the *same* two hosts, one target each, interleaved, so the ratio
  soft/tcp is the transport's own cost on this machine, not the box's load.
* ``cluster``: a client host reading, through its kspeedfs mount, a dataset preloaded
  into the memory of 3 peer nodes (``tests/fixtures/cluster.py``), next to the same
  files read from the source directory cold and warm, from a one-machine kspeedfs mount
  whose memory tier holds them (``kspeedfs-warm``) and from the RAM ceilings:
  sequential readers (one pass on a fresh mount, and time-based: its steady state),
  random 4 KiB reads (block READs), small files. The mount's CPU per GB is printed with
  the soft provider's engine threads' share beside it ("soft NIC": the work an RDMA NIC
  does in hardware, ``system.NIC_THREADS``).
* ``cluster-flap``: the same peer reads with one of the client's two NICs flapping in
  the background: the second rail must carry the reads (no read error) and the
  longest stall between two read completions says how long a failover takes.

The test-beds are started by the first target's ``setup`` and stopped by ``close`` (the
suite calls it from its ``finally``), so namespaces, mounts and processes go away on
failure and Ctrl-C as well.  ``python -m bench.cluster_read`` uses the same pieces.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import datasets, readers
from .datasets import Dataset
from .system import REPO, Mounts, daemon_pid, drop_caches
from .targets import Kspeedfs, KspeedfsStore, RamFS, SourceCold, SourceWarm, Target

if TYPE_CHECKING:
    from tests.fixtures.cluster import Cluster
    from tests.fixtures.netns import Host, Testbed

    from .workloads import Case, Context

log = logging.getLogger(__name__)

#: kspeedfs reads 4 MiB chunks; single-file extents of small files are ~110 KB.
TRANSPORT_SIZES = [("4MiB", 4 << 20), ("128KiB", 128 << 10), ("1MiB", 1 << 20)]
TRANSPORT_QD = 8
# the client's own chunk cache: fresh per run, room for every reader's prefetch window
CLIENT_CACHE = "256MiB"
FLAP_DOWN_S = 1.0            # NIC down this long, then up (carrier back) and as long again


def _fixtures() -> None:
    """The test-bed fixtures live in the checkout's tests/, not in an installed package."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))


# -- transport: rdma.perf soft READ vs one TCP stream ---------------------------------------

#: One measurement inside the client host: rdma.perf's own client functions, as JSON.
_PERF_CLIENT = (
    "import json, sys\n"
    "from dataclasses import asdict\n"
    "from rdma import perf\n"
    "mode, addr, port, size, qd, secs = sys.argv[1:]\n"
    "if mode == 'tcp':\n"
    "    r = perf.run_tcp(addr, int(port), int(size), float(secs), int(qd))\n"
    "else:\n"
    "    r = perf.run_rdma('soft', addr, int(port), perf.local_addr_for(addr), int(size),"
    " int(qd), float(secs))\n"
    "print(json.dumps(asdict(r)))\n"
)


class TransportBed:
    """Two hosts, a ``rdma.perf server`` (soft provider) on the second: both targets of
    the ``transport`` workload talk to the same server over the same veth rail."""

    def __init__(self) -> None:
        self.bed: Testbed | None = None
        self.endpoint: dict[str, Any] = {}

    def ensure(self) -> dict[str, Any]:
        if self.bed is not None:
            return self.endpoint
        _fixtures()
        from tests.fixtures.netns import Testbed

        self.bed = Testbed(hosts=2)
        self.bed.__enter__()
        client, server = self.bed.hosts
        srv = server.python(["-m", "rdma.perf", "server", "--provider", "soft", "--addr",
                             server.address(1), "--mr-size", "64MiB"], cwd=str(REPO))
        line = srv.readline_until("listening", timeout=60)
        port = int(line.split(f"{server.address(1)}:", 1)[1].split()[0])
        self.endpoint = {"netns": client.netns, "addr": server.address(1), "port": port}
        log.info("transport test-bed %s: perf server %s:%d", self.bed.run_id, server.address(1), port)
        return self.endpoint

    def close(self) -> None:
        if self.bed is not None:
            self.bed.close()
            self.bed = None


class TransportTarget(Target):
    """One transport (``soft`` or ``tcp``). Its path is a directory holding
    ``endpoint.json`` (client namespace, server address, mode): a case measures the
    transport by reading it, the way file cases read a target's directory."""

    def __init__(self, ds: Dataset, mode: str, bed: TransportBed) -> None:
        super().__init__(ds)
        self.name = mode
        self.bed = bed

    def setup(self, mounts: Mounts, work: Path) -> None:
        self.path = work / "transport" / self.name
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "endpoint.json").write_text(json.dumps({**self.bed.ensure(), "mode": self.name}))

    def prepare(self) -> None:
        """No page cache is involved; dropping it would only add noise."""

    def close(self) -> None:
        self.bed.close()


def perf_read(endpoint_dir: Path, size: int, qd: int, seconds: float) -> dict:
    """One ``rdma.perf`` run from the client host against the endpoint in ``endpoint_dir``;
    MB/s and CPU seconds per GB (client process, server process) as perf reports them."""
    ep = json.loads((endpoint_dir / "endpoint.json").read_text())
    argv = ["ip", "netns", "exec", ep["netns"], sys.executable, "-c", _PERF_CLIENT, ep["mode"],
            ep["addr"], str(ep["port"]), str(size), str(qd), str(seconds)]
    p = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=seconds + 60)
    if p.returncode:
        raise RuntimeError(f"rdma.perf {ep['mode']} failed ({p.returncode}): {p.stderr.strip()[-2000:]}")
    r = json.loads(p.stdout.strip().splitlines()[-1])
    out = {"MB/s": r["gbytes_per_s"] * 1000, "msgs/s": r["msgs_per_s"], "bytes": r["bytes"],
           "seconds": r["seconds"], "client_cpu_s_per_gb": r["client_cpu_s_per_gb"],
           "server_cpu_s_per_gb": r["server_cpu_s_per_gb"]}
    if r.get("lat_p50_us") is not None:
        out.update(lat_p50_us=r["lat_p50_us"], lat_p99_us=r["lat_p99_us"])
    return out


def transport_dataset(ctx: Context) -> Dataset:
    """No files: the transport moves bytes from one memory region to another."""
    return Dataset("transport", ctx.work / "transport", 0, 0)


def transport_targets(ds: Dataset, ctx: Context) -> list[Target]:
    bed = TransportBed()
    return [TransportTarget(ds, "soft", bed), TransportTarget(ds, "tcp", bed)]


def transport_cases(ds: Dataset, ctx: Context) -> list[Case]:
    from .workloads import Case

    secs = float(min(ctx.scale.runtime, 3))

    def case(label: str, size: int) -> Case:
        return Case(f"read-{label}-qd{TRANSPORT_QD}", lambda p: perf_read(p, size, TRANSPORT_QD, secs),
                    "MB/s", also=("client_cpu_s_per_gb", "server_cpu_s_per_gb"))
    return [case(label, size) for label, size in TRANSPORT_SIZES]


# -- the cluster: a client reading from 3 peers ---------------------------------------------

class ClusterBed:
    """etcd + 3 nodes + a client host, the dataset imported and preloaded into the nodes'
    memory once; mounts on the client are made and removed per measured run."""

    dataset = "bench"

    def __init__(self, base: Path, ds: Dataset, nodes: int = 3, chunk: str = "4MiB") -> None:
        self.base = base
        self.ds = ds
        self.chunk = chunk
        self.nodes = nodes
        self.cluster: Cluster | None = None
        self.flappers: list[Flapper] = []
        self.preload_s = 0.0

    def ensure(self) -> Cluster:
        if self.cluster is not None:
            return self.cluster
        _fixtures()
        from tests.fixtures.cluster import Cluster

        shutil.rmtree(self.base, ignore_errors=True)      # etcd data of an earlier run
        # every node holds its share of R=2 replicas, with room to spare
        mem = (self.ds.bytes * 2 // self.nodes + (256 << 20)) >> 20
        self.cluster = c = Cluster(self.base, nodes=self.nodes, chunk_size=self.chunk,
                                   node_memory=f"{mem}MiB")
        c.start()
        # the chunk size too, not only the nodes' slot size: without it, from 61262dd on,
        # --cluster-chunk-size put 4 MiB chunks into larger slots
        c.ks(["import", str(self.ds.root), "--name", self.dataset, "--chunk-size", self.chunk,
              "-q"], timeout=1800)
        t0 = time.monotonic()
        c.ks(["preload", self.dataset, "--timeout", "900"], timeout=1000)
        self.preload_s = time.monotonic() - t0
        log.info("cluster %s: %d MB preloaded into %d nodes in %.1fs", c.bed.run_id,
                 self.ds.bytes // 10**6, self.nodes, self.preload_s)
        return c

    def mount(self, mounts: Mounts, *extra: str, cache: str = CLIENT_CACHE,
              tree: Path | None = None) -> Path:
        """A fresh client mount (empty chunk cache of ``cache``; kspeedfs from ``tree``,
        else this checkout), registered for the suite's cleanup."""
        c = self.ensure()
        mp = c.base / f"mnt{len(c.mounts)}"
        mounts.add(mp, lambda: daemon_pid(mp))
        got = c.mount(self.dataset, "--cache-mem", cache, *extra, tree=tree)
        assert got == mp, (got, mp)
        return mp

    def flapper(self, rail: int) -> Flapper:
        """A flapper of one of the client's NICs, stopped before the hosts go away."""
        f = Flapper(self.ensure().client, rail)
        self.flappers.append(f)
        return f

    def close(self) -> None:
        for f in self.flappers:
            f.stop()
        if self.cluster is not None:
            self.cluster.close()
            self.cluster = None
        shutil.rmtree(self.base, ignore_errors=True)


class Flapper:
    """Takes one NIC of a host down for ``FLAP_DOWN_S``, up again, waits, repeats, in a
    thread, until stopped; the NIC is always left up."""

    def __init__(self, host: Host, rail: int) -> None:
        self.host, self.rail = host, rail
        self.flaps = 0
        self.error: Exception | None = None
        self._stop = threading.Event()
        self._t: threading.Thread | None = None

    def start(self) -> None:
        self._stop.clear()
        self._t = threading.Thread(target=self._run, name="nic-flapper", daemon=True)
        self._t.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.host.nic_down(self.rail)
                try:
                    self._stop.wait(FLAP_DOWN_S)
                finally:
                    self.host.nic_up(self.rail)
                self.flaps += 1
                self._stop.wait(FLAP_DOWN_S)
        except Exception as e:          # the run then measures fewer flaps; say why
            log.error("flapping %s eth%d: %s", self.host.name, self.rail, e)
            self.error = e

    def stop(self) -> None:
        self._stop.set()
        if self._t is not None:
            self._t.join(timeout=30)
            self._t = None


class PeersTarget(Target):
    """The client's kspeedfs mount reading from the peers: a fresh mount per run (so its
    own chunk cache is empty) and the page cache dropped; with ``flap_rail`` one of the
    client's NICs flaps during the run; with ``fits`` its chunk cache holds the whole
    dataset (a small file is then read with its whole chunk: ``ReadPolicy.small_file``),
    else it is ``CLIENT_CACHE``."""

    def __init__(self, ds: Dataset, bed: ClusterBed, flap_rail: int = 0, fits: bool = False,
                 tree: Path | None = None) -> None:
        super().__init__(ds)
        self.bed = bed
        self.flap_rail = flap_rail
        self.tree = tree                # --ab-tree: the mount runs that tree's kspeedfs
        # room for every chunk (files start chunks, so the chunks hold more than the bytes)
        self.cache = f"{(ds.bytes * 5 // 4 + (64 << 20)) >> 20}MiB" if fits else CLIENT_CACHE
        self.name = (f"kspeedfs-peers-flap-eth{flap_rail}" if flap_rail
                     else "kspeedfs-peers-fits" if fits
                     else "B:kspeedfs-peers" if tree else "kspeedfs-peers")
        self.mounts: Mounts | None = None
        self.mp: Path | None = None
        self.flapper: Flapper | None = None

    def setup(self, mounts: Mounts, work: Path) -> None:
        self.mounts = mounts
        if self.flap_rail:
            self.flapper = self.bed.flapper(self.flap_rail)
        else:
            self.bed.ensure()

    def prepare(self) -> None:
        self.finish()
        assert self.mounts is not None
        self.mp = self.path = self.bed.mount(self.mounts, cache=self.cache, tree=self.tree)
        drop_caches()
        if self.flapper:
            self.flapper.start()

    def daemon(self) -> int | None:
        return daemon_pid(self.mp) if self.mp is not None else None

    def peers(self) -> list[int]:
        c = self.bed.cluster
        return [] if c is None else [p.pid for name, p in c.procs.items()
                                     if name != "etcd" and p.poll() is None]

    def finish(self) -> None:
        if self.flapper:
            self.flapper.stop()
        if self.mp is not None and self.mounts is not None:
            self.mounts.remove(self.mp)
            self.mp = None

    def stats(self) -> dict | None:
        if self.mp is None:
            return None
        try:
            out = json.loads(os.getxattr(self.mp, "user.kspeedfs.stats"))
        except OSError:
            return None
        if self.flapper:
            out["nic_flaps"] = self.flapper.flaps
        return out

    def close(self) -> None:
        self.finish()
        self.bed.close()


def cluster_dataset(ctx: Context) -> Dataset:
    """4 large files and, when every case runs (not ``--quick``), ImageNet-like small
    files, as two subtrees of one tree: one import, one preload and one cluster serve
    both cases (kspeedfs imports symlinks as symlinks, so the parts are real directories).
    ``cluster-flap`` reads only the large files but uses the same tree (made once)."""
    size = min(ctx.scale.seq_size, 256 << 20)
    n = min(ctx.scale.imagenet_files, 5_000) if not ctx.scale.max_cases else 0
    root = ctx.work / "data" / (f"cluster-4x{size >> 20}M" + (f"-imagenet{n}" if n else ""))
    parts = [datasets.big_files(root, 4, size)]
    if n:
        parts.append(datasets.imagenet(root, n))
    ds = Dataset("cluster", root, sum(p.files for p in parts), sum(p.bytes for p in parts))
    # written only when it changes: its mtime is the tree's marker for kspeedfs-warm's
    # store (KspeedfsStore.ensure), which a rewrite would re-import on every run
    listing = "".join(f"{p.root.name}/{rel}\n" for p in parts for rel in p.paths())
    if not ds.listing().exists() or ds.listing().read_text() != listing:
        ds.listing().write_text(listing)
    return ds


def seq_read(root: Path, paths: Sequence[str], workers: int = 4, seconds: float = 0.0,
             block: int = 1 << 20) -> dict:
    """``workers`` threads, each reading its share of ``paths`` whole and in order with
    ``block``-sized reads (the GIL is released in every read). With ``seconds`` they
    go round again until that long has passed, dropping each file's cached pages before
    every later pass, so a NIC flap falls inside the run. A failed read is counted, not
    raised: the error count and the longest gap between two read completions (any
    reader) are figures of the run."""
    lock = threading.Lock()
    state = {"bytes": 0, "errors": 0, "last": 0.0, "gap": 0.0, "passes": 0}
    deadline = time.perf_counter() + seconds

    def done(n: int) -> None:
        now = time.perf_counter()
        with lock:
            state["bytes"] += n
            state["gap"] = max(state["gap"], now - state["last"])
            state["last"] = now

    def reader(mine: Sequence[str]) -> None:
        buf = bytearray(block)
        again = False           # the first pass finds the page cache as the target left it
        while True:
            for rel in mine:
                try:
                    fd = os.open(os.path.join(root, rel), os.O_RDONLY)
                    try:
                        if again:
                            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                        while n := os.readv(fd, [buf]):
                            done(n)
                    finally:
                        os.close(fd)
                except OSError as e:
                    log.warning("read %s: %s", rel, e)
                    with lock:
                        state["errors"] += 1
            with lock:
                state["passes"] += 1
            if time.perf_counter() >= deadline:
                return
            again = True

    # daemon threads: on Ctrl-C the suite unmounts under them and exits without waiting
    threads = [threading.Thread(target=reader, args=(paths[i::workers],), daemon=True)
               for i in range(workers)]
    t0 = state["last"] = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    return {"MB/s": state["bytes"] / dt / 1e6, "bytes": state["bytes"], "seconds": dt,
            "errors": state["errors"], "max_gap_s": state["gap"], "passes": state["passes"] / workers}


def _seq_paths(ds: Dataset) -> list[str]:
    return [p for p in ds.paths() if p.startswith("files-")]


def cluster_targets(ds: Dataset, ctx: Context) -> list[Target]:
    bed = ClusterBed(ctx.work / "cluster", ds, chunk=ctx.cluster_chunk)
    # ramfs-c: the ceiling the peer-read CPU target is stated against (client CPU-s per GB)
    ramfs_c = [RamFS(ds, "c", ctx.ramfs_c)] if ctx.ramfs_c else []
    # --ab-tree: the same peers read by a mount of another checkout (ratios B / A)
    ab = [PeersTarget(ds, bed, tree=ctx.ab_tree)] if ctx.ab_tree else []
    # kspeedfs-warm: one machine, its memory tier holding the dataset (the files/s the
    # peer-read target is stated against), imported into an embedded store of its own
    warm = Kspeedfs(ds, KspeedfsStore(ctx.work, ds, chunk=ctx.cluster_chunk), warm=True)
    return [SourceCold(ds), SourceWarm(ds), PeersTarget(ds, bed), *ab,
            PeersTarget(ds, bed, fits=True), warm, RamFS(ds, "py"), *ramfs_c]


def cluster_cases(ds: Dataset, ctx: Context) -> list[Case]:
    from .workloads import Case, fio_random

    seq = _seq_paths(ds)
    seq_bytes = sum(os.path.getsize(ds.root / p) for p in seq)
    out = [Case("seq-4-readers", lambda p: seq_read(p, seq), "MB/s", also=("max_gap_s", "errors"))]
    # the same, time-based: passes after the first measure a mount in its steady state,
    # not a fresh one's first touches of its buffers (0.38 GB/s on this VM's new memory)
    secs = {"quick": 4.0, "medium": 8.0}.get(ctx.scale.name, 12.0)
    out.append(Case(f"seq-4-readers-{secs:.0f}s", lambda p: seq_read(p, seq, seconds=secs), "MB/s",
                    also=("errors", "passes")))

    # the client's tier (CLIENT_CACHE) is smaller than the data: each random miss is one
    # 128 KiB block READ from a peer, not a 4 MiB chunk
    out.append(Case("rand-4k-j4", lambda p: fio_random(p, seq, seq_bytes, "4k", 4, ctx.scale.runtime),
                    "IOPS"))
    small = [p for p in ds.paths() if p.startswith("imagenet-")]
    if small:
        out.append(Case("imagenet-8-workers", lambda p: readers.whole_files(str(p), small, 8), "files/s"))
    return out


def flap_targets(ds: Dataset, ctx: Context) -> list[Target]:
    bed = ClusterBed(ctx.work / "cluster", ds, chunk=ctx.cluster_chunk)
    return [PeersTarget(ds, bed), PeersTarget(ds, bed, flap_rail=1)]


def flap_cases(ds: Dataset, ctx: Context) -> list[Case]:
    """Time-based (several flaps per run), the same for the flapping and the quiet target."""
    from .workloads import Case

    seq = _seq_paths(ds)
    secs = {"quick": 6.0, "medium": 10.0}.get(ctx.scale.name, 12.0)
    return [Case(f"seq-4-readers-{secs:.0f}s", lambda p: seq_read(p, seq, seconds=secs), "MB/s",
                 also=("max_gap_s", "errors", "passes"))]


CLUSTER_RATIOS = [("kspeedfs-peers", "source-cold"), ("kspeedfs-peers", "source-warm"),
                  ("kspeedfs-peers", "ramfs-py"), ("kspeedfs-peers", "ramfs-c"),
                  ("kspeedfs-peers", "kspeedfs-warm"), ("kspeedfs-warm", "ramfs-c"),
                  ("kspeedfs-peers-fits", "kspeedfs-peers"), ("kspeedfs-peers-fits", "ramfs-c"),
                  ("B:kspeedfs-peers", "kspeedfs-peers"), ("B:kspeedfs-peers", "ramfs-c")]
FLAP_RATIOS = [("kspeedfs-peers-flap-eth1", "kspeedfs-peers")]
TRANSPORT_RATIOS = [("soft", "tcp")]
