"""Runs INSIDE Soft-RoCE guest ``a`` (tests/vm/test_verbs_failover.py boots a and b).

Guest b serves ``tests/rdma/vrdma_peer.py serve`` (the same peer program as the netns
failover tests, unchanged) on rxe0/rxe1; guest a streams READs through
``vrdma_peer.py stream`` and follows its JSON events with the same ``Client`` as
tests/rdma/test_vrdma_failover.py.  Two wires, one per rail::

    a.eth0 198.18.1.1 ── wire 0 ── b.eth0 198.18.1.2
    a.eth1 198.18.2.1 ── wire 1 ── b.eth1 198.18.2.2

Failures are injected on a's side: ``ip link set eth1 down`` (a local link-down: rxe
fails the path's WRs with LOC_QP_OP_ERR at once) and ``netem loss 100%`` on eth0 (the
link stays up and nothing reports an error: only heartbeats can tell, before the RC
retry budget of the path QPs would).  Each fault is injected ``KS_FAULT_REPEAT`` times
(default 3).  Results go to /run/ks/results.jsonl as JSON lines.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from rdma.qp_state import total_timeout_seconds  # noqa: E402
from rdma.vrdma.heartbeat import HeartbeatConfig  # noqa: E402
from tests.fixtures.netns import HostProcess  # noqa: E402
from tests.rdma.test_vrdma_failover import Client  # noqa: E402

PEER = str(REPO / "tests/rdma/vrdma_peer.py")
RUN = Path(os.environ.get("KS_RUN", "/run/ks"))
RESULTS = RUN / "results.jsonl"
SECRET = os.environ.get("KS_SECRET", "00" * 16)
PORT = int(os.environ.get("KS_PORT", "7471"))
B = ["198.18.1.2", "198.18.2.2"]
P0, P1 = "198.18.1.1->198.18.1.2", "198.18.2.1->198.18.2.2"
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1


def report(test: str, **data: Any) -> None:
    with open(RESULTS, "a") as f:
        f.write(json.dumps({"test": test, **data}) + "\n")


def sh(cmd: str) -> None:
    subprocess.run(["/bin/sh", "-c", cmd], check=True)


def set_link(ifname: str, up: bool) -> None:
    """``ip link set IF up/down`` without spawning ``ip``: in a one-vCPU TCG guest a
    process spawn stalls everything (the stream's event loop too) for 0.5-1 s, which
    the heartbeats rightly read as every path going silent."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifr = struct.pack("16sh22x", ifname.encode(), 0)
        flags = struct.unpack("16sh22x", fcntl.ioctl(s, SIOCGIFFLAGS, ifr))[1]
        flags = (flags | IFF_UP) if up else (flags & ~IFF_UP)
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sh22x", ifname.encode(), flags))


def do(action: Any) -> None:
    action() if callable(action) else sh(action)


def wait_for_server(timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection((B[0], PORT), timeout=1.0).close()
            return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"guest b never listened on {B[0]}:{PORT}")


def _start_stream(tmp_path: Path, attempt: int) -> tuple[HostProcess, Client, Path, Path]:
    out, stop = tmp_path / f"completions{attempt}.json", tmp_path / f"stop{attempt}"
    err = RUN / f"a.stream{attempt}.log"        # kept on the run share for the host
    argv = [sys.executable, PEER, "stream", "--peer", ",".join(B), "--port", str(PORT),
            "--secret", SECRET, "--qd", "8", "--out", str(out), "--stop-file", str(stop),
            "--duration", "240", "--log", os.environ.get("KS_LOG", "INFO")]
    with open(err, "w") as ef:
        popen = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=ef, text=True,
                                 cwd=REPO, start_new_session=True)
    proc = HostProcess(popen, argv, "guest-a", err)
    return proc, Client(proc), out, stop


def _reap(proc: HostProcess, stop: Path) -> None:
    stop.touch()
    try:
        proc.popen.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.popen.wait(10)
    if proc.popen.stdout is not None:
        proc.popen.stdout.close()


@pytest.fixture
def client(tmp_path: Path) -> Any:
    """A connected stream.  A path build (TCP connect + handshake + QP setup) has
    ``connect_timeout`` = 1 s; a starved TCG guest sometimes needs more for the very
    first one, so the bootstrap is retried (reported), never the failover itself."""
    wait_for_server()
    for attempt in range(4):
        proc, c, out, stop = _start_stream(tmp_path, attempt)
        try:
            c.wait(lambda e: e["ev"] == "connected", 60, "connected")
        except AssertionError as exc:
            _reap(proc, stop)
            report("stream_bootstrap_retry", attempt=attempt, error=str(exc)[-300:])
            if attempt == 3:
                raise
            continue
        try:
            yield c, out, stop
        finally:
            _reap(proc, stop)
        return


def _fault(c: Client, path: str, inject: Any, repair: Any) -> dict[str, Any]:
    t_fail = time.monotonic()
    do(inject)                 # spawning `tc` in a TCG guest takes ~0.5-1 s
    t_applied = time.monotonic()
    down = c.path_event(path, "DOWN", timeout=10)
    time.sleep(1.0)                                   # traffic on the surviving path only
    t_up = time.monotonic()
    do(repair)
    up = c.path_event(path, "UP", timeout=60)
    c.spread(timeout=60)
    return {"t_fail": t_fail, "t_applied": t_applied,
            "detect_ms": round((down["t"] - t_fail) * 1e3, 1),
            "inject_cmd_ms": round((t_applied - t_fail) * 1e3, 1),
            "detect_after_cmd_ms": round((down["t"] - t_applied) * 1e3, 1),
            "down_reason": down["reason"], "rebuild_ms": round((up["t"] - t_up) * 1e3, 1)}


def _pcts(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "p50_ms": round(statistics.median(xs) * 1e3, 1),
            "p99_ms": round(xs[min(len(xs) - 1, int(len(xs) * 0.99))] * 1e3, 1),
            "max_ms": round(xs[-1] * 1e3, 1)}


def _window(comp: dict[str, list[float]], f: dict[str, Any]) -> tuple[list[float], list[float]]:
    """Completion gaps and READ latencies from just before the command that injected the
    fault until 1 s after it returned (the fault lands somewhere inside the command)."""
    t0, t1 = f["t_fail"] - 0.1, f["t_applied"] + 1.0
    win = sorted((t, lt) for t, lt in zip(comp["done_t"], comp["lat"], strict=False) if t0 <= t <= t1)
    ts = [t for t, _ in win]
    return [b - a for a, b in pairwise(ts)], [lt for _, lt in win]


REPEAT = int(os.environ.get("KS_FAULT_REPEAT", "3"))
FAULTS = {
    "link_down_eth1": (P1, lambda: set_link("eth1", False), lambda: set_link("eth1", True)),
    "netem_loss_eth0": (P0, "tc qdisc add dev eth0 root netem loss 100%",
                        "tc qdisc del dev eth0 root"),
}


def test_failover_zero_failed_reads(client: Any) -> None:
    c, out, stop = client
    sh("tc qdisc show dev eth0 >/dev/null")   # warm tc's pages before it matters
    c.spread(timeout=60)
    faults: dict[str, list[dict[str, Any]]] = {k: [] for k in FAULTS}
    for _ in range(REPEAT):
        for kind, (path, inject, repair) in FAULTS.items():
            faults[kind].append(_fault(c, path, inject, repair))
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
    for kind, fs in faults.items():
        gaps: list[float] = []
        lats: list[float] = []
        for f in fs:
            g, lt = _window(comp, f)
            gaps += g
            lats += lt
        res[kind] = {"stall_gap": _pcts(gaps), "read_latency": _pcts(lats),
                     "faults": [{k: v for k, v in f.items() if not k.startswith("t_")}
                                for f in fs]}
    report("vrdma_failover", **res)
    assert done["n_failures"] == 0, done["failures"]
    assert done["reads"] > 100
    # silent loss: no error anywhere; the heartbeat declared the path DOWN before the
    # path QPs' RC retry budget ran out (else the reason would be the RETRY_EXC_ERR WC)
    for f in faults["netem_loss_eth0"]:
        assert "heartbeat" in f["down_reason"], f
