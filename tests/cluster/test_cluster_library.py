"""The Python library on a cluster: ``kspeedfs.open_dataset(..., etcd=[...])`` on the client
host reads a preloaded dataset from the nodes' memory over vRDMA — the source gone, one
node killed — every byte verified, as a mount does (the same Reader, compose.py)."""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.cluster import cluster

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces)")

def _write_files(src: Path, files: dict[str, bytes]) -> Path:
    """``files`` (relative path → bytes) written under ``src``; returns ``src``."""
    for rel, data in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    return src


def _library_config(common: list[str]) -> dict[str, str]:
    """The cluster's ``--set KEY=VALUE`` options as the library's config mapping."""
    return dict(common[i + 1].split("=", 1) for i in range(len(common)) if common[i] == "--set")


def _spec(path: Path, etcd: list[str], config: dict[str, str], files: dict[str, bytes]) -> Path:
    """The reader script's spec: where etcd is, the config, each file's SHA-256."""
    path.write_text(json.dumps({
        "etcd": etcd, "config": config,
        "sha": {rel: hashlib.sha256(data).hexdigest() for rel, data in files.items()}}))
    return path


READER = """
import hashlib, json, sys
import kspeedfs
spec = json.load(open(sys.argv[1]))
with kspeedfs.open_dataset("libds", etcd=spec["etcd"], config=spec["config"]) as ds:
    names = sorted(spec["sha"])
    got = ds.read_many(names[:len(names) // 2])
    got += [ds.read(n) for n in names[len(names) // 2:]]
    bad = [n for n, data in zip(names, got) if hashlib.sha256(data).hexdigest() != spec["sha"][n]]
    with ds.open("large.bin") as f:          # sequential: prefetch from the peers
        f.seek(12345)
        tail = f.read()
    s = ds.statistics()
    print(json.dumps({"bad": bad, "tail": hashlib.sha256(tail).hexdigest(),
                      "peer_hits": s.peer_hits, "source_loads": s.source_loads,
                      "source_extents": s.source_extents, "checksum_failures": s.corrupt_discarded}))
"""


def test_the_library_reads_from_the_peers_with_the_source_gone_and_a_node_dead(
        tmp_path: Path) -> None:
    rnd = random.Random(45)
    files = {f"c{i % 4}/img{i:03d}.jpg": rnd.randbytes(rnd.randint(1, 60_000)) for i in range(80)}
    files["large.bin"] = rnd.randbytes(3 << 20)
    src = _write_files(tmp_path / "src", files)
    with cluster(tmp_path / "c", nodes=3) as c:
        c.ks(["import", str(src), "--name", "libds", "--chunk-size", c.chunk_size, "-q"])
        c.ks(["preload", "libds", "--timeout", "90"])
        shutil.rmtree(src)                      # from now on only the nodes hold it
        c.kill_node(1)
        config = _library_config(c.common())
        spec = _spec(tmp_path / "spec.json", c.etcd_urls, config, files)
        r = subprocess.run(c.client_argv([sys.executable, "-c", READER, str(spec)]),
                           capture_output=True, text=True, timeout=180,
                           cwd=str(Path(__file__).resolve().parents[2]))
        assert r.returncode == 0, r.stderr[-3000:]
        out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["bad"] == []
    assert out["tail"] == hashlib.sha256(files["large.bin"][12345:]).hexdigest()
    assert out["peer_hits"] > 0
    assert out["source_loads"] == out["source_extents"] == 0


NATIVE_READER = """
import hashlib, json, sys, threading
import kspeedfs
spec = json.load(open(sys.argv[1]))
names = sorted(spec["sha"])

def rounds(ds, n):
    bad = []
    def run(i):
        for _ in range(n):
            for name in names[i::8]:
                if hashlib.sha256(ds.read(name)).hexdigest() != spec["sha"][name]:
                    bad.append(name)
    ts = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    pw = ds._loop.peer_wait
    return {"bad": bad, "native": pw.reads if pw else -1,
            "source_loads": ds.statistics().source_loads}

with kspeedfs.open_dataset("libds", etcd=spec["etcd"], config=spec["config"]) as ds:
    print(json.dumps(rounds(ds, 2)), flush=True)
    sys.stdin.readline()                    # the test kills a node as the next rounds start
    print(json.dumps(rounds(ds, 6)), flush=True)
"""


def test_small_files_come_from_peers_through_c_and_a_node_killed_mid_read_is_no_error(
        tmp_path: Path) -> None:
    """The library's reading threads READ small files from the peers in C
    (cluster/peer_wait.py); a node killed while they do is never the reader's error: its
    READs fail or come late in C, and those files take the Python read path (failover)."""
    rnd = random.Random(46)
    files = {f"d{i % 8}/f{i:03d}.bin": rnd.randbytes(rnd.randint(15_000, 30_000))
             for i in range(600)}
    src = _write_files(tmp_path / "src", files)
    with cluster(tmp_path / "c", nodes=3) as c:
        c.ks(["import", str(src), "--name", "libds", "--chunk-size", c.chunk_size, "-q"])
        c.ks(["preload", "libds", "--timeout", "90"])
        shutil.rmtree(src)                      # from now on only the nodes hold it
        config = _library_config(c.common())
        config["cache.memory"] = "8MiB"         # smaller than the data: files read alone
        spec = _spec(tmp_path / "spec.json", c.etcd_urls, config, files)
        p = subprocess.Popen(c.client_argv([sys.executable, "-c", NATIVE_READER, str(spec)]),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True,
                             cwd=str(Path(__file__).resolve().parents[2]))
        try:
            assert p.stdout is not None and p.stdin is not None
            line = p.stdout.readline()
            while line and not line.startswith("{"):
                line = p.stdout.readline()
            assert line, p.communicate(timeout=60)[1][-3000:]
            before = json.loads(line)
            p.stdin.write("\n")
            p.stdin.flush()
            c.kill_node(1)
            out, err = p.communicate(timeout=180)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        assert p.returncode == 0, err[-3000:]
        after = json.loads(out.strip().splitlines()[-1])
    assert before["bad"] == [] and after["bad"] == []
    assert before["native"] > 0                 # C READ some files in the first rounds
    assert after["native"] > before["native"]   # and goes on with the nodes left
    assert after["source_loads"] == 0
