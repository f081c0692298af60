"""A node with ``cluster.host_readers`` grants a local user its dataset's arena segments
(``cluster/grant.py``): a process running as ``nobody`` on the node's host maps them
read-only and reads every chunk the node holds, verified against its key."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from kspeedfs.cluster.arena import ENTRY
from tests.fixtures import grant_client
from tests.fixtures.cluster import cluster

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces, nobody)")

NOBODY = 65534

READER = r'''
import json, mmap, socket, sys, xxhash
from tests.fixtures import grant_client
path, keys = sys.argv[1], json.loads(sys.argv[2])
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect(path)
maps, out = {}, {}
def ask(req):
    reply, fds = grant_client.ask(s, req)
    for seg, fd in zip(reply.get("segments", []), fds):
        maps[seg] = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    return reply
out["other"] = ask({"v": 1, "op": "grant", "dataset": "other"})
s.close()
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect(path)
g = ask({"v": 1, "op": "grant", "dataset": "imgs"})
per = g["segment_bytes"] // g["slot_size"]
located = ask({"v": 1, "op": "locate", "keys": keys})
good = 0
for key, hit in zip(keys, located["slots"]):
    if hit:
        slot, length = hit
        data = maps[slot // per][slot % per * g["slot_size"]:][:length]
        good += xxhash.xxh3_128_hexdigest(data) == key
out.update(grant=g, located=sum(1 for h in located["slots"] if h), verified=good)
print(json.dumps(out))
'''


def test_a_local_user_reads_its_granted_dataset_from_the_node(tmp_path: Path) -> None:
    src = tmp_path / "source"
    src.mkdir()
    rnd = random.Random(5)
    for i in range(6):
        (src / f"f{i}.bin").write_bytes(rnd.randbytes(rnd.randint(100_000, 600_000)))
    run = Path(tempfile.mkdtemp(prefix="kspeedfs-grant-"))
    run.chmod(0o755)                                 # nobody reaches the socket
    sock = run / "kspeedfs" / "n1.grant"
    try:
        with cluster(tmp_path / "c", nodes=1, node_memory="16MiB",
                     extra=["--set", "cluster.host_readers=imgs=uid:65534",
                            "--set", f"cluster.grant_socket={run}/kspeedfs/{{node}}.grant",
                            "--set", "cluster.segment_bytes=1MiB", "--set", "cluster.replicas=1"]
                     ) as c:
            c.ks(["import", str(src), "--name", "imgs", "--chunk-size", c.chunk_size, "-q"])
            c.ks(["preload", "imgs", "--timeout", "60"])
            index = next(c.arena_dir.glob("*-n1.index")).read_bytes()
            keys = [k.hex() for k, _, length, _ in ENTRY.iter_unpack(index) if length]
            assert len(keys) > 4
            assert oct(sock.parent.stat().st_mode & 0o777) == "0o755"
            assert oct(sock.stat().st_mode & 0o777) == "0o666"
            result = _read_as_nobody(sock, keys)
            # restarted, the node adopts its chunks (in segments of no group) and gives
            # them back to "imgs" once its first reconcile pass knows the groups
            c.kill_node(1)
            c.start_node(1)
            deadline = time.monotonic() + 30
            while (again := _read_as_nobody(sock, keys))["located"] < len(keys):
                assert time.monotonic() < deadline, again
                time.sleep(0.5)
            assert "given back to their datasets" in c.log_text()
    finally:
        subprocess.run(["rm", "-rf", str(run)], check=False)
    assert result["other"]["errno"] == "EACCES"
    assert result["grant"]["ok"] and result["grant"]["segments"]
    assert result["located"] == result["verified"] == len(keys)
    assert again["verified"] == len(keys)


def _read_as_nobody(sock: Path, keys: list[str]) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", READER, str(sock), json.dumps(keys)],
                         user=NOBODY, group=NOBODY, cwd="/", capture_output=True,
                         env=grant_client.script_env(), text=True, check=True, timeout=60)
    result: dict[str, Any] = json.loads(out.stdout)
    return result
