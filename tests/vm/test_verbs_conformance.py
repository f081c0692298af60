"""The verbs provider on the real kernel RDMA stack: one Soft-RoCE guest (rxe0 and rxe1
on the two ends of one wire) runs tests/vm/guest/guest_verbs_conformance.py — the
provider conformance suite of rdma/testing.py, unchanged, plus real failure statuses —
and each check is reported here as its own test.  Opt-in: ``./run test-vm``."""
from __future__ import annotations

import json
from typing import Any

import pytest

from tests.vm import qemu
from tests.vm.guest.guest_verbs_conformance import CASES
from tests.vm.results import junit_outcomes, result_lines

pytestmark = [pytest.mark.vm, pytest.mark.timeout(900)]
GUEST_TESTS = "tests/vm/guest/guest_verbs_conformance.py"


@pytest.fixture(scope="module")
def guest(vm_image: qemu.Image, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    run = tmp_path_factory.mktemp("vm-conformance")
    payload = qemu.pytest_payload(f"{GUEST_TESTS} --junitxml=/run/ks/a.junit.xml",
                                  env={"KS_RESULTS": "/run/ks/results.jsonl"})
    spec = qemu.GuestSpec("a", [qemu.Nic(0, 0, "198.18.1.1/24"),
                                qemu.Nic(0, 1, "198.18.1.2/24")], payload, loopwire=True)
    res = qemu.run_guests([spec], run, timeout=780, image=vm_image)["a"]
    outcomes = junit_outcomes(run / "a.junit.xml")
    results = result_lines(run / "results.jsonl")
    print(f"\nVM guest a: rc={res.rc} wall={res.wall_s:.1f}s ready_at={res.boot_s}s")
    for r in results:
        if r["test"] != "conformance":
            print("VM-RESULT", json.dumps(r))
    if not outcomes:
        pytest.fail(f"the guest ran no tests (rc={res.rc}); console:\n{res.tail}")
    return {"res": res, "outcomes": outcomes, "results": results, "run": run}


def _outcome(guest: dict[str, Any], name: str) -> None:
    outcome, msg = guest["outcomes"].get(name, ("missing", "not in the guest's junit"))
    if outcome == "skipped":
        pytest.skip(f"in the guest: {msg}")
    assert outcome == "passed", f"{name} in the guest: {outcome}\n{msg}"


@pytest.mark.parametrize("check,where", CASES)
def test_conformance_on_rxe(guest: dict[str, Any], check: str, where: str) -> None:
    _outcome(guest, f"test_conformance[{check}-{where}]")


@pytest.mark.parametrize("name", [
    "test_devices_have_roce_v2_ipv4_gids",
    "test_dead_responder_is_retry_exc_err[14-2]",
    "test_dead_responder_is_retry_exc_err[14-6]",
    "test_dead_responder_is_retry_exc_err[14-7]",
    "test_dead_responder_is_retry_exc_err[10-6]",
    "test_netem_loss_is_retry_exc_err",
    "test_local_link_down_is_loc_qp_op_err",
    "test_completion_latency_thread_vs_direct",
])
def test_real_verbs_behaviour(guest: dict[str, Any], name: str) -> None:
    _outcome(guest, name)


def test_guest_exit_status(guest: dict[str, Any]) -> None:
    res = guest["res"]
    assert res.rc == 0, f"guest pytest rc={res.rc}\n{res.tail}"
