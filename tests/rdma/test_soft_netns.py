"""The soft provider between two test hosts (network namespaces, veth NICs): READs over
a real veth path, a silent path (egress drop) → RETRY_EXC_ERR within the budget, and
(slow lane) the bandwidth ratio against plain TCP on the same path.  Needs root."""
from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator

import pytest

from tests.fixtures.netns import HostProcess, Testbed, TestbedError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")


@pytest.fixture(scope="module")
def bed() -> Iterator[Testbed]:
    try:
        with Testbed(hosts=2, rails=1) as tb:
            yield tb
    except TestbedError as exc:  # pragma: no cover - e.g. no ip(8) / netns support
        pytest.skip(f"testbed unavailable: {exc}")


def _server(bed: Testbed, mr_size: str = "16MiB") -> tuple[HostProcess, str, int]:
    h1 = bed.hosts[1]
    proc = h1.python(["-m", "rdma.perf", "server", "--provider", "soft",
                      "--addr", h1.address(1), "--mr-size", mr_size], cwd=REPO)
    line = proc.readline_until("listening on", timeout=20)
    addr, port = line.split("listening on ")[1].split()[0].rsplit(":", 1)
    return proc, addr, int(port)


def _client(bed: Testbed, addr: str, port: int, *args: str) -> HostProcess:
    return bed.hosts[0].python(["-m", "rdma.perf", "client", "--provider", "soft",
                                "--addr", addr, "--port", str(port), "--json", *args], cwd=REPO)


def _last_json(proc: HostProcess, timeout: float) -> object:
    out, _ = proc.popen.communicate(timeout=timeout)
    lines = [ln for ln in out.splitlines() if ln.startswith(("[", "{"))]
    assert lines, f"no JSON from client (rc={proc.popen.returncode}): {out!r} {proc.stderr_tail()}"
    return json.loads(lines[-1])


def test_read_over_a_veth_path_is_correct(bed: Testbed) -> None:
    server, addr, port = _server(bed)
    try:
        for size in ("1", "4097", "1MiB"):
            res = _last_json(_client(bed, addr, port, "--size", size, "--qd", "8",
                                     "--duration", "0.3", "--verify"), 60)
            assert isinstance(res, list) and res[0]["messages"] > 0, res
    finally:
        server.terminate()


@pytest.mark.parametrize("fault", ["server_drop", "server_nic_down", "client_nic_down"])
def test_dead_path_is_retry_exc_err_within_budget(bed: Testbed, fault: str) -> None:
    """A path that goes silent (egress drop, link stays up) or loses a NIC: the client's
    READs complete RETRY_EXC_ERR after timeout_ms × (retry_cnt+1) = 0.2 s × 3 without
    progress (TCP alone would keep retransmitting for minutes)."""
    server, addr, port = _server(bed)
    h0, h1 = bed.hosts
    host = h1 if fault.startswith("server") else h0
    try:
        client = _client(bed, addr, port, "--size", "64KiB", "--qd", "4", "--duration", "30",
                         "--timeout-ms", "200", "--retry-cnt", "2")
        time.sleep(1.5)
        assert client.poll() is None, client.stderr_tail()
        if fault.endswith("drop"):
            host.drop(1)
        else:
            host.nic_down(1)
        t0 = time.monotonic()
        res = _last_json(client, 20)
        took = time.monotonic() - t0
        assert isinstance(res, dict) and res["error"] == "IBV_WC_RETRY_EXC_ERR", res
        assert res["after_s"] <= 0.6 + 0.5, res
        if fault != "client_nic_down":  # a local NIC loss may fail sends at once
            assert res["after_s"] >= 0.6 * 0.9, res
        assert took < 5, took
    finally:
        host.undrop(1)
        if host.link_state(1) != "UP":
            host.nic_up(1)
        server.terminate()


@pytest.mark.slow
def test_perf_reads_and_tcp_baseline_over_veth(bed: Testbed) -> None:
    """``rdma.perf`` with ``--tcp-baseline`` (the bench's ``transport`` workload) runs
    between two netns hosts: every repetition of both modes moves data. The soft/TCP
    ratio itself is a figure of the bench, not an assertion here: on this 2-vCPU box the
    1 MiB case ranges 0.76-1.54 between runs."""
    server, addr, port = _server(bed, "64MiB")
    try:
        res = _last_json(_client(bed, addr, port, "--size", "1MiB", "--qd", "8", "--duration",
                                 "3", "--repeat", "3", "--cq-mod", "4", "--tcp-baseline"), 180)
        assert isinstance(res, list)
        assert sorted(r["mode"] for r in res) == ["rdma"] * 3 + ["tcp"] * 3, res
        assert all(r["gbytes_per_s"] > 0 and r["size"] == 1 << 20 for r in res), res
        rd = sum(r["gbytes_per_s"] for r in res if r["mode"] == "rdma")
        tc = sum(r["gbytes_per_s"] for r in res if r["mode"] == "tcp")
        print(f"soft READ / TCP over veth, 1 MiB qd 8: {rd / tc:.2f}")
    finally:
        server.terminate()


