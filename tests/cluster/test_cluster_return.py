"""A node coming back costs verifying readers no more than a fault does.

Its own cluster (etcd + 3 nodes, R = 2, 256 KiB chunks, ~47 MiB preloaded) and a mount
with an 8 MiB memory tier, so almost every read goes to a peer. Readers verify every byte
and time every read (open + 64 KiB). Node 2 is SIGKILLed and started again a second
later, keeping its arena (``cluster.arena_dir``). It comes back as a new incarnation, so
the mount must connect to it again. The slowest read from its start until 4 s after it
says ready is compared with the slowest read of two no-fault windows of the same
readers, one before the kill and one after the return. While the other replica of each
chunk is connected, no read waits for the connect to the returning node (docs/design.md,
"A node coming back").

The measured figures are printed (``pytest -s``).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.cluster.test_cluster_tail import Readers
from tests.fixtures.cluster import cluster, mount_stats, write_dataset

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces, FUSE)")

#: how much longer than the no-fault window's slowest read the slowest read around the
#: return may be
MARGIN = 0.100
AFTER_READY = 4.0          # seconds read after the node says ready
#: seconds of each no-fault window, before the kill and after the return (the second at
#: least as long as the return's): a load spike lands in either as likely as in the return
CALM = 6.0


class Timeline(Readers):
    """Readers that keep every read as (start, end), monotonic seconds."""

    def __init__(self, mnt: Path, files: dict[str, bytes], n: int, seed: int = 0) -> None:
        super().__init__(mnt, files, n, seed)
        self.reads: list[tuple[float, float]] = []

    def done(self, start: float, end: float) -> None:
        self.reads.append((start, end))

    def longest(self, since: float, until: float) -> float:
        """The slowest read that ended in [since, until), s."""
        return max((e - s for s, e in self.reads if since <= e < until), default=0.0)

    def count(self, since: float, until: float) -> int:
        return sum(1 for _, e in self.reads if since <= e < until)

    def slowest(self, since: float, until: float, at: float, n: int = 3) -> str:
        """The ``n`` slowest reads that ended in [since, until): each as its start
        relative to ``at`` and its length, and how many other reads overlapped it (all
        readers at once: the whole process or machine stalled, not one read)."""
        ends = sorted(((s, e) for s, e in self.reads if since <= e < until),
                      key=lambda r: r[0] - r[1])[:n]
        return ", ".join(
            f"{(s - at) * 1e3:+.0f}+{(e - s) * 1e3:.0f} ms "
            f"({sum(1 for s2, e2 in self.reads if s2 < e and e2 > s) - 1} overlapped)"
            for s, e in ends)

    def __enter__(self) -> Timeline:
        super().__enter__()
        return self


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("return")
    src = base / "source"
    files = write_dataset(src, seed=48, files=200, classes=4, shards=4, shard_size=8 << 20)
    with cluster(base / "c") as c:
        c.ks(["import", str(src), "--name", "ret", "--chunk-size", c.chunk_size, "-q"])
        assert "complete" in c.ks(["preload", "ret", "--timeout", "60"]).stdout
        mnt = c.mount("ret", "--set", "cache.memory=8MiB")
        yield c, files, mnt


def one_return(c, files: dict[str, bytes], mnt: Path) -> tuple[float, float]:
    """Node 2 killed and started again under 8 verifying readers: the slowest read from
    its start to AFTER_READY s after it is ready, and the slowest of the no-fault windows
    around it. Asserts what must hold at every return: no error, node 2 serving again,
    no read waiting for its connect."""
    with Timeline(mnt, files, 8) as rd:
        time.sleep(1.0)                     # a fresh mount's first reads (its connects)
        t_calm0 = time.monotonic()
        time.sleep(CALM)
        before = mount_stats(mnt)
        t_kill = time.monotonic()
        c.kill_node(2)
        time.sleep(1.0)
        t_start = time.monotonic()
        c.start_node(2)                     # until it says "ready"
        t_ready = time.monotonic()
        time.sleep(AFTER_READY)
        t_end = time.monotonic()
        after = mount_stats(mnt)
        c.wait_nodes(3)
        t_calm = time.monotonic()
        time.sleep(max(CALM, t_end - t_start))
        t_calm_end = time.monotonic()
    calm = max(rd.longest(t_calm0, t_kill), rd.longest(t_calm, t_calm_end))
    killed = rd.longest(t_kill, t_start)
    back = rd.longest(t_start, t_end)
    calm_reads = rd.count(t_calm0, t_kill) + rd.count(t_calm, t_calm_end)
    print(f"\nnode 2 ready {t_ready - t_start:.2f} s after its start; slowest read: no fault "
          f"{calm * 1e3:.0f} ms ({calm_reads} reads), killed {killed * 1e3:.0f} ms, from "
          f"its start to {AFTER_READY:g} s after ready "
          f"{back * 1e3:.0f} ms ({rd.count(t_start, t_end)} reads; before ready "
          f"{rd.longest(t_start, t_ready) * 1e3:.0f} ms, after "
          f"{rd.longest(t_ready, t_end) * 1e3:.0f} ms); reads that waited for a connect "
          f"{after['peer_connect_waits'] - before['peer_connect_waits']}; slowest "
          f"from the start, relative to ready: {rd.slowest(t_start, t_end, t_ready)}")
    assert rd.errors == [], rd.errors[:5]
    assert after["per_peer_bytes"]["n2"] > before["per_peer_bytes"]["n2"]   # it serves again
    assert after["peer_connect_waits"] == before["peer_connect_waits"]
    return back, calm


def test_a_node_coming_back_costs_readers_no_more_than_a_fault(world) -> None:
    """The bound holds at one of two returns: a stall of the whole machine lands in the
    return window by chance (seen once in a CI run: one 308 ms read after ready against a
    42 ms no-fault maximum), a cost of the return lands in both."""
    tries = []
    for _ in range(2):
        back, calm = one_return(*world)
        tries.append((round(back, 3), round(calm, 3)))
        if back <= calm + MARGIN:
            return
    raise AssertionError(f"slowest read around the return beyond the no-fault one + "
                         f"{MARGIN * 1e3:.0f} ms at both returns (s): {tries}")
