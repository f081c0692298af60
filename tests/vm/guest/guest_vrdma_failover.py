"""Runs INSIDE Soft-RoCE guest ``a`` (tests/vm/t7_verbs_failover.py boots a and b).

Guest b serves ``tests/rdma/vrdma_peer.py serve`` (the same peer program as the netns
failover tests, unchanged) on rxe0/rxe1; guest a streams READs through
``vrdma_peer.py stream`` and follows its JSON events with the same ``Client`` and
``gap_stats`` as tests/rdma/t3_vrdma_failover.py.  Two wires, one per rail::

    a.eth0 198.18.1.1 ── wire 0 ── b.eth0 198.18.1.2
    a.eth1 198.18.2.1 ── wire 1 ── b.eth1 198.18.2.2

Failures are injected on a's side: ``ip link set eth1 down`` (a local link-down: rxe
fails the path's WRs with LOC_QP_OP_ERR at once) and ``netem loss 100%`` on eth0 (the
link stays up and nothing reports an error: only heartbeats can tell, before the RC
retry budget of the path QPs would).  Results go to $KS_RESULTS as JSON lines.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from rdma.qp_state import total_timeout_seconds  # noqa: E402
from rdma.vrdma.heartbeat import HeartbeatConfig  # noqa: E402
from tests.fixtures.netns import HostProcess  # noqa: E402
from tests.rdma.t3_vrdma_failover import Client, gap_stats  # noqa: E402

PEER = str(REPO / "tests/rdma/vrdma_peer.py")
RUN = Path(os.environ.get("KS_RUN", "/run/ks"))
RESULTS = RUN / "results.jsonl"
SECRET = os.environ.get("KS_SECRET", "00" * 16)
PORT = int(os.environ.get("KS_PORT", "7471"))
B = ["198.18.1.2", "198.18.2.2"]
P0, P1 = "198.18.1.1->198.18.1.2", "198.18.2.1->198.18.2.2"


def report(test: str, **data: Any) -> None:
    with open(RESULTS, "a") as f:
        f.write(json.dumps({"test": test, **data}) + "\n")


def sh(cmd: str) -> None:
    subprocess.run(["/bin/sh", "-c", cmd], check=True)


def wait_for_server(timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection((B[0], PORT), timeout=1.0).close()
            return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"guest b never listened on {B[0]}:{PORT}")


@pytest.fixture
def client(tmp_path: Path) -> Any:
    wait_for_server()
    out, stop = tmp_path / "completions.json", tmp_path / "stop"
    err = tmp_path / "stream.stderr"
    argv = [sys.executable, PEER, "stream", "--peer", ",".join(B), "--port", str(PORT),
            "--secret", SECRET, "--qd", "8", "--out", str(out), "--stop-file", str(stop),
            "--duration", "240"]
    with open(err, "w") as ef:
        popen = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=ef, text=True,
                                 cwd=REPO, start_new_session=True)
    proc = HostProcess(popen, argv, "guest-a", err)
    c = Client(proc)
    try:
        c.wait(lambda e: e["ev"] == "connected", 60, "connected")
        yield c, out, stop
    finally:
        stop.touch()
        try:
            popen.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            popen.wait(10)
        if popen.stdout is not None:
            popen.stdout.close()


def _fault(c: Client, path: str, inject: str, repair: str) -> dict[str, Any]:
    t_fail = time.monotonic()
    sh(inject)                 # spawning `ip`/`tc` in a TCG guest takes a while
    t_applied = time.monotonic()
    down = c.path_event(path, "DOWN", timeout=10)
    time.sleep(1.0)                                   # traffic on the surviving path only
    t_up = time.monotonic()
    sh(repair)
    up = c.path_event(path, "UP", timeout=30)
    c.spread(timeout=30)
    return {"t_fail": t_fail, "detect_ms": round((down["t"] - t_fail) * 1e3, 1),
            "inject_cmd_ms": round((t_applied - t_fail) * 1e3, 1),
            "detect_after_cmd_ms": round((down["t"] - t_applied) * 1e3, 1),
            "down_reason": down["reason"], "rebuild_ms": round((up["t"] - t_up) * 1e3, 1)}


def test_failover_zero_failed_reads(client: Any) -> None:
    c, out, stop = client
    c.spread(timeout=30)
    link = _fault(c, P1, "ip link set eth1 down", "ip link set eth1 up")
    loss = _fault(c, P0, "tc qdisc add dev eth0 root netem loss 100%",
                  "tc qdisc del dev eth0 root")
    stop.touch()
    done = c.wait(lambda e: e["ev"] == "done", 60, "done")
    assert c.proc.popen.wait(30) == 0
    comp = json.loads(out.read_text())
    cfg = HeartbeatConfig()
    res: dict[str, Any] = {
        "reads": done["reads"], "n_failures": done["n_failures"],
        "failed_over": done["stats"]["reads_failed_over"],
        "heartbeat_detect_bounds_ms": [round(x * 1e3) for x in cfg.detection_bounds()],
        "qp_retry_budget_ms": round(total_timeout_seconds(cfg.qp_timeout_exp,
                                                           cfg.qp_retry_cnt) * 1e3)}
    for label, side in (("link_down_eth1", link), ("netem_loss_eth0", loss)):
        g = gap_stats(comp["done_t"], comp["lat"], side["t_fail"])
        res[label] = {**{k: round(v, 1) for k, v in g.items()},
                      **{k: v for k, v in side.items() if k != "t_fail"}}
    report("vrdma_failover", **res)
    assert done["n_failures"] == 0, done["failures"]
    assert done["reads"] > 100
    # silent loss: no error anywhere; the heartbeat declared the path DOWN before the
    # path QPs' RC retry budget ran out (else the reason would be the RETRY_EXC_ERR WC)
    assert "heartbeat" in loss["down_reason"], loss
