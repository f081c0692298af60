"""A real mount serving Prometheus metrics (``metrics.listen``), scraped with urllib.

One mount with ``metrics.listen`` on a free loopback port, one without (it must open
no socket). The scrapes are parsed with prometheus_client's own parser.
"""
from __future__ import annotations

import os
import random
import socket
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.system import daemon_pid
from tests.fixtures.mounts import CHUNK, Cluster1

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> tuple[str, Samples]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200
        text = r.read().decode()
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return text, out


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum over every sample of ``name`` whose labels include ``labels``."""
    return sum(v for (n, ls), v in samples.items()
               if n == name and set(labels.items()) <= set(ls))


@pytest.fixture(scope="module")
def mounted(tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("metrics")
    src = base / "src"
    src.mkdir()
    rnd = random.Random(7)
    for i in range(3):
        (src / f"f{i}.bin").write_bytes(rnd.randbytes(3 * CHUNK + 1000))
    (src / "d").mkdir()
    (src / "d" / "small.txt").write_bytes(b"x" * 100)
    c = Cluster1(base)
    c.import_(src, "met")
    port = free_port()
    mnt = c.mount("met", None, "--set", f"metrics.listen=127.0.0.1:{port}")
    try:
        yield c, src, mnt, port
    finally:
        c.close()


def test_counters_move_when_a_file_is_read(mounted) -> None:
    c, src, mnt, port = mounted
    _, before = scrape(port)
    data = (mnt / "f0.bin").read_bytes()
    assert data == (src / "f0.bin").read_bytes()
    text, after = scrape(port)
    assert value(after, "kspeedfs_read_bytes_total") - value(before, "kspeedfs_read_bytes_total") \
        >= len(data)
    assert value(after, "kspeedfs_read_requests_total") > value(before, "kspeedfs_read_requests_total")
    assert value(after, "kspeedfs_chunk_requests_total", tier="source") \
        >= value(before, "kspeedfs_chunk_requests_total", tier="source") + 4   # 4 chunks
    assert value(after, "kspeedfs_cache_used_bytes", tier="memory") >= len(data)
    assert value(after, "kspeedfs_fuse_operations_total", op="read") \
        > value(before, "kspeedfs_fuse_operations_total", op="read")
    assert value(after, "kspeedfs_fuse_operation_seconds_count", op="open") >= 1
    assert value(after, "kspeedfs_fuse_operation_seconds_bucket", op="read", le="+Inf") \
        == value(after, "kspeedfs_fuse_operations_total", op="read")
    if os.environ.get("KSPEEDFS_FUSE_ENGINE", "native") == "native":   # C missed, Python loaded
        assert value(after, "kspeedfs_fuse_read_misses_total") \
            > value(before, "kspeedfs_fuse_read_misses_total")
    else:
        assert "kspeedfs_fuse_read_misses_total" not in text
    # constant labels: which mount this is
    assert value(after, "kspeedfs_read_bytes_total", dataset="met", version="1",
                 mountpoint=str(mnt)) == value(after, "kspeedfs_read_bytes_total")
    # a second read of the same file comes from memory
    (mnt / "f0.bin").read_bytes()
    os.stat(mnt / "d" / "small.txt")
    _, again = scrape(port)
    assert value(again, "kspeedfs_fuse_operations_total", op="lookup") >= 1
    assert value(again, "kspeedfs_chunk_requests_total", tier="memory") >= \
        value(after, "kspeedfs_chunk_requests_total", tier="memory")


def test_errors_are_counted_per_op(mounted) -> None:
    c, src, mnt, port = mounted
    _, before = scrape(port)
    with pytest.raises(FileNotFoundError):
        os.stat(mnt / "no-such-file")
    _, after = scrape(port)
    assert value(after, "kspeedfs_fuse_errors_total", op="lookup") \
        == value(before, "kspeedfs_fuse_errors_total", op="lookup") + 1


def test_names_and_labels_follow_the_conventions(mounted) -> None:
    c, src, mnt, port = mounted
    (mnt / "f1.bin").read_bytes()
    text, samples = scrape(port)
    files = {p.name for p in src.rglob("*") if p.is_file()}   # f0.bin ... small.txt
    for fam in text_string_to_metric_families(text):
        assert fam.name.startswith("kspeedfs_"), fam.name
        if fam.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in fam.samples), fam.name
        for s in fam.samples:
            assert set(s.labels) <= {"dataset", "version", "mountpoint", "tier", "op", "peer",
                                     "le"}, (s.name, s.labels)
            assert not any(f in v for v in s.labels.values() for f in files), s


def listening(pid: int) -> int:
    """TCP sockets process ``pid`` listens on."""
    lines = Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]
    inodes = {ln.split()[9] for ln in lines if ln.split()[3] == "0A"}        # 0A: LISTEN
    fds = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
    return len({f"socket:[{i}]" for i in inodes} & fds)


def test_a_mount_without_metrics_listen_opens_no_port(mounted) -> None:
    c, src, mnt, port = mounted
    plain = c.mount("met")
    assert listening(daemon_pid(mnt)) == 1
    assert listening(daemon_pid(plain)) == 0
