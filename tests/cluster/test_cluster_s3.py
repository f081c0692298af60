"""A bucket prefix preloaded into the nodes: their loads go through the same origin as a
mount's misses (ranged GETs pinned to ETags, verified); a preload during which the object
store hangs finishes once it answers again; and once preloaded a mount reads every byte
from the peers, even with the object store gone.

The S3 server (moto) runs on the etcd host, listening on its rail-1 address, which the
nodes and the client reach; the endpoint is given to the import only (``--set
source.endpoint``): the nodes take it from the manifest's source record.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fixtures.cluster import cluster, mount_stats
from tests.fixtures.s3 import ACCESS_KEY, REGION, SECRET_KEY, moto_on_host

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces, FUSE)")

FILL = """
import boto3, json, sys
files = json.load(open(sys.argv[2]))
c = boto3.client("s3", endpoint_url=sys.argv[1])
c.create_bucket(Bucket="kst-cluster")
for key, n in files.items():
    c.put_object(Bucket="kst-cluster", Key="ds/" + key, Body=bytes.fromhex(n))
    # other bytes: chunks are cached by content, and ds's would already be there
    c.put_object(Bucket="kst-cluster", Key="ds2/" + key, Body=b"2" + bytes.fromhex(n))
"""


def test_preload_from_a_bucket_then_read_from_peers(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    for k in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(k)
    # every process of the cluster inherits dummy credentials and no endpoint
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_REGION", REGION)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    rnd = random.Random(44)
    files = {f"c{i % 4}/img{i:03d}.jpg": rnd.randbytes(rnd.randint(1, 60_000)) for i in range(120)}
    files["large.bin"] = rnd.randbytes(3 << 20)
    spec = tmp_path / "files.json"
    spec.write_text(json.dumps({k: v.hex() for k, v in files.items()}))
    # short attempts, so that a hung server fails loads within the test's patience
    with cluster(tmp_path / "c", nodes=2,
                 extra=["--set", "source.timeout=1", "--set", "source.retries=2"]) as c:
        moto, endpoint = moto_on_host(c.etcd_host, c.client)
        c.client.run([sys.executable, "-c", FILL, endpoint, str(spec)], timeout=120)

        c.ks(["import", "s3://kst-cluster/ds", "--name", "s3ds", "--chunk-size", c.chunk_size,
              "-q", "--set", f"source.endpoint={endpoint}"])
        c.ks(["preload", "s3ds", "--timeout", "90"])
        assert c.ks(["preload", "s3ds", "--check"]).returncode == 0
        status = json.loads(c.ks(["status", "--json"]).stdout)
        deadline = time.monotonic() + 15            # nodes publish stats every 2 s
        while sum(st["counters"]["source_loads"] for st in status["stats"].values()) == 0:
            assert time.monotonic() < deadline, status["stats"]
            time.sleep(0.5)
            status = json.loads(c.ks(["status", "--json"]).stdout)

        # the server hangs (SIGSTOP) while a second preload runs: the nodes' GETs time out
        # (1 s) and are retried (the client's, then reconcile's), and it finishes
        c.ks(["import", "s3://kst-cluster/ds2", "--name", "s3ds2", "--chunk-size",
              c.chunk_size, "-q", "--set", f"source.endpoint={endpoint}"])
        mark = c.output_mark()
        moto.stop()
        preload = subprocess.Popen(c.client_argv([
            sys.executable, "-m", "kspeedfs.cli.app", "preload", "s3ds2", "--timeout", "120",
            *c.common()]), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 60       # hung while the nodes load, for 4 s
        while "s3ds2@1: " not in c.output_since(mark).partition("loading (preload)")[0]:
            assert time.monotonic() < deadline, c.output_since(mark)
            time.sleep(0.2)
        time.sleep(4)
        moto.cont()
        out, _ = preload.communicate(timeout=150)
        assert preload.returncode == 0, out + c.output_since(mark)[-3000:]
        assert c.ks(["preload", "s3ds2", "--check"]).returncode == 0
        nodes_said = c.output_since(mark)
        assert "kst-cluster/ds2/" in nodes_said and "retrying" in nodes_said, nodes_said
        assert "Connection pool is full" not in nodes_said, nodes_said

        moto.terminate()                            # the bucket is gone: peers only
        mnt = c.mount("s3ds")
        for rel, data in files.items():
            assert (mnt / rel).read_bytes() == data, rel
        s = mount_stats(mnt)
        assert s["source_loads"] == 0 and s["peer_hits"] > 0, s
