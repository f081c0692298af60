"""The library on a node's host reads the node's chunks through the grant socket
(``cluster/granted.py``): a process running as ``nobody`` in the client's network
namespace (etcd and the peers are reached from there; the grant socket is a path, so
any namespace reaches it) opens a preloaded dataset with the source gone.

Granted, it copies every chunk out of the node's mapped segments (``host_hits``) and
READs none over vRDMA; not granted, it reads as before (``peer_hits``, no host hits);
with the granted node killed halfway, the rest still comes verified from the other
replica. Every byte is checked against the source's sha256."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures import grant_client
from tests.fixtures.cluster import Cluster, cluster

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces, nobody)")

NOBODY = 65534
STRANGER = 65533                     # a uid with no grant

# argv: spec (JSON). Reads spec["first"], prints its statistics, waits for a line on
# stdin (the test kills a node meanwhile), reads spec["rest"], prints again.
READER = r'''
import hashlib, json, logging, sys, time
import kspeedfs
logging.basicConfig(level=logging.INFO)
spec = json.loads(sys.argv[1])

def stats(ds):
    s = ds.statistics()
    return {"host_hits": s.host_hits, "host_bytes": s.host_bytes, "peer_hits": s.peer_hits,
            "reads": s.reads, "in_loop": s.python_reads,
            "source_loads": s.source_loads + s.source_extents + s.source_blocks}

with kspeedfs.open_dataset("hostds", etcd=spec["etcd"], config=spec["config"]) as ds:
    bad = []
    for part in ("first", "rest"):
        names = spec[part]
        got = ds.read_many(names[:len(names) // 2]) + [ds.read(n) for n in names[len(names) // 2:]]
        bad += [n for n, d in zip(names, got) if hashlib.sha256(d).hexdigest() != spec["sha"][n]]
        print(json.dumps({"part": part, "bad": bad, **stats(ds)}), flush=True)
        if part == "first" and spec["pause"]:
            sys.stdin.readline()
            time.sleep(spec["pause"])
'''


def _files(seed: int) -> dict[str, bytes]:
    rnd = random.Random(seed)
    files = {f"c{i % 4}/img{i:03d}.jpg": rnd.randbytes(rnd.randint(1, 60_000)) for i in range(60)}
    for i in range(6):
        files[f"large{i}.bin"] = rnd.randbytes((1 << 20) + rnd.randint(0, 99_999))
    return files


@pytest.fixture
def run_dir() -> Iterator[Path]:
    """A directory nobody can reach: the grant sockets and the reader's secret."""
    run = Path(tempfile.mkdtemp(prefix="kspeedfs-hostread-"))
    run.chmod(0o755)
    try:
        yield run
    finally:
        subprocess.run(["rm", "-rf", str(run)], check=False)


@contextlib.contextmanager
def _preloaded(tmp_path: Path, run: Path, nodes: int,
               replicas: int) -> Iterator[tuple[Cluster, dict[str, bytes]]]:
    """A cluster granting ``hostds`` to nobody, the dataset preloaded, its source gone."""
    files = _files(7)
    src = tmp_path / "src"
    for rel, data in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    with cluster(tmp_path / "c", nodes=nodes, node_memory="32MiB",
                 extra=["--set", f"cluster.host_readers=hostds=uid:{NOBODY}",
                        "--set", f"cluster.grant_socket={run}/sockets/{{cluster}}-{{node}}.grant",
                        "--set", "cluster.segment_bytes=1MiB",
                        "--set", f"cluster.replicas={replicas}"]) as c:
        c.ks(["import", str(src), "--name", "hostds", "--chunk-size", c.chunk_size, "-q"])
        c.ks(["preload", "hostds", "--timeout", "90"])
        shutil.rmtree(src)                  # from now on only the nodes hold it
        yield c, files


def _spec(c: Cluster, run: Path, files: dict[str, bytes], uid: int,
          first: list[str], rest: list[str], pause: float = 0) -> str:
    """The reader's spec: the cluster's options (the secret copied for ``uid``)."""
    common = c.common()
    config = {common[i + 1].split("=", 1)[0]: common[i + 1].split("=", 1)[1]
              for i in range(len(common)) if common[i] == "--set"}
    secret = run / f"secret-{uid}"
    shutil.copyfile(c.secret, secret)
    os.chown(secret, uid, uid)
    secret.chmod(0o600)
    # a memory tier smaller than the dataset: small files are read alone (read_policy.py)
    config.update({"cluster.secret_file": str(secret), "cluster.leave_grace": "0",
                   "cache.memory": "8MiB"})
    config.pop("log.dir", None)
    return json.dumps({"etcd": c.etcd_urls, "config": config, "first": first, "rest": rest,
                       "pause": pause,
                       "sha": {rel: hashlib.sha256(d).hexdigest() for rel, d in files.items()}})


def _reader(c: Cluster, uid: int, spec: str) -> subprocess.Popen[str]:
    """The library as ``uid`` on the client host (nsenter drops to it after entering)."""
    argv = ["nsenter", f"--net=/run/netns/{c.client.netns}", "--setuid", str(uid),
            "--setgid", str(uid), sys.executable, "-c", READER, spec]
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd="/",
                            env=grant_client.script_env())


def _run(c: Cluster, uid: int, spec: str) -> list[dict[str, Any]]:
    p = _reader(c, uid, spec)
    out, err = p.communicate(timeout=180)
    assert p.returncode == 0, err[-3000:]
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_a_granted_library_reads_the_nodes_chunks_from_its_memory(tmp_path: Path,
                                                                  run_dir: Path) -> None:
    with _preloaded(tmp_path, run_dir, nodes=1, replicas=1) as (c, files):
        names = sorted(files)
        small = [n for n in names if n.endswith(".jpg")]
        first, again = _run(c, NOBODY, _spec(c, run_dir, files, NOBODY, names, small))
        stranger = _run(c, STRANGER, _spec(c, run_dir, files, STRANGER, names, small))[-1]
    assert first["bad"] == [] and again["bad"] == [] and stranger["bad"] == []
    assert first["host_hits"] > 0 and first["host_bytes"] >= sum(map(len, files.values()))
    assert again["peer_hits"] == 0 and again["source_loads"] == 0
    # read again, the small files the loop did not read (and keep in the memory tier)
    # are copied from the grant in the caller's thread again (client/reads.py); without
    # a grant (the stranger) the callers' threads READ them from the peers through C
    # (cluster/peer_wait.py), counted as peer hits, never as host hits
    outside = [r["reads"] - r["in_loop"] for r in (first, again, stranger)]
    assert outside[1] - outside[0] >= len(small) // 4
    assert again["host_hits"] - first["host_hits"] >= len(small) // 4
    assert stranger["host_hits"] == 0 and stranger["peer_hits"] > 0
    assert stranger["source_loads"] == 0


@pytest.mark.parametrize("other_socket", [False, True], ids=["alone", "other-node-here"])
def test_reads_go_on_when_the_granting_node_dies(tmp_path: Path, run_dir: Path,
                                                 other_socket: bool) -> None:
    """n1 grants (every node's socket is "on this host" in the test bed: the first by
    name is asked first) and is killed halfway. ``alone``: n2's socket removed, as on a
    host with n1 only: the rest comes from n2 over vRDMA. ``other-node-here``: the
    library finds n2's grant once n1 has left the membership, and reads on from it."""
    with _preloaded(tmp_path, run_dir, nodes=2, replicas=2) as (c, files):
        if not other_socket:
            (n2,) = (run_dir / "sockets").glob("*-n2.grant")
            n2.unlink()
        small = sorted(n for n in files if n.endswith(".jpg"))
        large = sorted(n for n in files if n.endswith(".bin"))
        spec = _spec(c, run_dir, files, NOBODY, small + large[:2], large[2:], pause=8.0)
        p = _reader(c, NOBODY, spec)
        assert p.stdout is not None and p.stdin is not None
        before = json.loads(p.stdout.readline())
        c.kill_node(1)                              # its lease lapses within 5 s
        p.stdin.write("go\n")
        p.stdin.flush()
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err[-3000:]
        after = json.loads(out.splitlines()[-1])
    assert before["bad"] == [] and after["bad"] == []
    assert before["host_hits"] > 0 and before["peer_hits"] == 0
    assert after["source_loads"] == 0
    assert "host grant of hostds from n1 dropped" in err
    if other_socket:
        assert after["host_hits"] > before["host_hits"] and after["peer_hits"] == 0
        assert "host grant: hostds from node n2" in err
    else:
        assert after["peer_hits"] > 0               # the rest from n2, over vRDMA
        assert after["host_hits"] == before["host_hits"]
