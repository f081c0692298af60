"""A node started with the wrong cluster secret, on real test hosts.

Before record signing, such a node joined: ``kspeedfs status`` listed it, placement
gave it chunks, it loaded them from the source and served nobody (every handshake with
it fails), silently lowering every dataset's real replica count. Now its record is
signed with a key the cluster does not hold: the three honest nodes, the CLI and the
mount ignore it (one log line each), so status lists 3 nodes, preload completes with R
verified copies among the 3, and a mount reads everything from the 3 without an error.
"""
from __future__ import annotations

import json
import os
import random
import secrets
import sys
import time
from pathlib import Path

import pytest

from tests.fixtures.cluster import cluster

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces, FUSE)")


def test_wrong_secret_node_never_enters_placement(tmp_path: Path) -> None:
    rnd = random.Random(13)
    src = tmp_path / "source"
    files = {f"d{i % 3}/f{i:03d}": rnd.randbytes(rnd.randint(1_000, 300_000)) for i in range(60)}
    for rel, data in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    wrong = tmp_path / "wrong-secret"
    wrong.write_text(secrets.token_hex(32))
    wrong.chmod(0o600)
    with cluster(tmp_path / "c") as c:
        c.ks(["import", str(src), "--name", "ds", "--chunk-size", c.chunk_size, "-q"])
        h = c.client                                      # a host of its own, two NICs
        rogue = h.popen([sys.executable, "-m", "kspeedfs.cli.app", "node", "--name", "n4",
                         "--nic", h.address(1), "--nic", h.address(2),
                         "--cache-mem", c.node_memory, *c.common(),
                         "--set", f"cluster.secret_file={wrong}"],
                        cwd=str(Path(__file__).resolve().parents[2]))
        rogue.readline_until("ready", timeout=30)
        time.sleep(2)                                     # its record is in etcd by now
        assert sorted(c.nodes()) == ["n1", "n2", "n3"]
        status = c.ks(["status"])
        assert "3 live node(s)" in status.stdout and "n4" not in status.stdout
        assert "refusing etcd key" in status.stderr and "nodes/n4" in status.stderr

        assert "complete" in c.ks(["preload", "ds", "--timeout", "60"]).stdout
        check = c.ks(["preload", "ds", "--check"]).stdout
        assert "3 live nodes" in check and "every chunk has R verified copies" in check, check

        mnt = c.mount("ds")
        for rel, want in files.items():
            assert (mnt / rel).read_bytes() == want, rel
        stats = json.loads(os.getxattr(mnt, "user.kspeedfs.stats"))
        assert "n4" not in stats["per_peer_bytes"] and stats["source_loads"] == 0, stats
        text = c.log_text()
        assert "nodes/n4" in text and "refusing etcd key" in text
