"""vRDMA failover on real verbs: two Soft-RoCE guests, two wires (one per rail).

Guest b runs ``tests/rdma/vrdma_peer.py serve`` — the same peer program as the netns
failover tests — and guest a runs tests/vm/guest/guest_vrdma_failover.py, which streams
READs through ``vrdma_peer.py stream`` while it takes its eth1 down and then drops
everything on eth0 with netem: zero failed READs, the stall around each failure, and the
heartbeat (not the RC retry budget) detecting the silent loss.  Opt-in: ``./run test-vm``.
"""
from __future__ import annotations

import json
import os
from typing import Any

import pytest

from tests.vm import qemu
from tests.vm.results import junit_outcomes, result_lines

pytestmark = [pytest.mark.vm, pytest.mark.timeout(900)]
GUEST_TESTS = "tests/vm/guest/guest_vrdma_failover.py"
PORT = 7471


def _server_payload(secret: str, python: str) -> str:
    """Guest b: serve until guest a's payload is done (a.rc appears on the run share)."""
    return f"""set -u
cd {qemu.REPO}
{python} tests/rdma/vrdma_peer.py serve --secret {secret} --port {PORT} \\
    --size {8 << 20} --log INFO > /run/ks/b.serve.log 2>&1 &
pid=$!
i=0
while [ ! -e /run/ks/a.rc ] && [ $i -lt 1500 ]; do sleep 0.4; i=$((i + 1)); done
kill -TERM $pid; wait $pid
exit 0
"""


@pytest.fixture(scope="module")
def guests(vm_image: qemu.Image, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    run = tmp_path_factory.mktemp("vm-failover")
    secret = os.urandom(16).hex()
    py = os.environ.get("KSPEEDFS_VM_PYTHON") or qemu._venv_python()
    a = qemu.GuestSpec("a", [qemu.Nic(0, 0, "198.18.1.1/24"), qemu.Nic(1, 0, "198.18.2.1/24")],
                       qemu.pytest_payload(f"{GUEST_TESTS} --junitxml=/run/ks/a.junit.xml",
                                           env={"KS_SECRET": secret, "KS_PORT": str(PORT)}))
    b = qemu.GuestSpec("b", [qemu.Nic(0, 1, "198.18.1.2/24"), qemu.Nic(1, 1, "198.18.2.2/24")],
                       _server_payload(secret, py))
    res = qemu.run_guests([a, b], run, timeout=780, image=vm_image)
    outcomes = junit_outcomes(run / "a.junit.xml")
    results = result_lines(run / "results.jsonl")
    for g in res.values():
        print(f"\nVM guest {g.name}: rc={g.rc} wall={g.wall_s:.1f}s ready_at={g.boot_s}s")
    for r in results:
        print("VM-RESULT", json.dumps(r))
    if not outcomes:
        pytest.fail(f"guest a ran no tests (rc={res['a'].rc}); console:\n{res['a'].tail}"
                    f"\n--- guest b:\n{res['b'].tail}")
    return {"res": res, "outcomes": outcomes, "results": results, "run": run}


def test_vrdma_failover_on_rxe(guests: dict[str, Any]) -> None:
    outcome, msg = guests["outcomes"].get("test_failover_zero_failed_reads",
                                          ("missing", "not in junit"))
    logs = ""
    for log in sorted(guests["run"].glob("a.stream*.log")) + [guests["run"] / "b.serve.log"]:
        lines = [ln for ln in log.read_text(errors="replace").splitlines()
                 if "traffic resumed" not in ln]
        logs += f"\n--- {log.name}:\n" + "\n".join(lines[-25:])
    assert outcome == "passed", f"{outcome}: {msg}{logs}"
    assert guests["res"]["a"].rc == 0 and guests["res"]["b"].rc == 0
