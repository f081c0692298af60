"""Nodes whose share does not fit their memory arena keep the rest on their SSD tier."""
from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import pytest

from tests.fixtures.cluster import cluster

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces, FUSE)")


def test_share_larger_than_memory_spills_to_ssd(tmp_path: Path) -> None:
    src = tmp_path / "source"
    rnd = random.Random(3)
    files = {f"f{i:03d}.bin": rnd.randbytes(rnd.randint(100_000, 400_000)) for i in range(80)}
    src.mkdir()
    for rel, data in files.items():
        (src / rel).write_bytes(data)
    ssd = tmp_path / "ssd"
    # 8 slots of 256 KiB per node (2 MiB) for a ~10 MiB share: most of it goes to the SSD
    with cluster(tmp_path / "c", nodes=2, node_memory="2MiB",
                 extra=["--set", f"cache.disk_dir={ssd}", "--set", "cache.disk=64MiB"]) as c:
        c.ks(["import", str(src), "--name", "big", "--chunk-size", c.chunk_size, "-q"])
        c.ks(["preload", "big", "--timeout", "60"])
        assert c.ks(["preload", "big", "--check"]).returncode == 0
        assert sum(1 for p in ssd.rglob("*") if p.is_file()) > 10
        hidden = src.rename(tmp_path / "hidden")
        mnt = c.mount("big")
        for rel, data in files.items():
            assert (mnt / rel).read_bytes() == data
        s = json.loads(os.getxattr(mnt, "user.kspeedfs.stats"))
        assert s["source_loads"] == 0 and s["peer_loads_requested"] > 0
        hidden.rename(src)
        deadline = time.monotonic() + 15                 # nodes publish stats every 2 s
        while True:
            status = json.loads(c.ks(["status", "--json"]).stdout)
            if sum(st["counters"]["disk_loads"] for st in status["stats"].values()) > 0:
                break
            assert time.monotonic() < deadline, status["stats"]
            time.sleep(0.5)
