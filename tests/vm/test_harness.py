"""Fast checks of the guest harness and of the verbs provider without devices (default
lane: no guest is booted here)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.vm import qemu

REPO = Path(__file__).resolve().parents[2]


def test_wires_connect_exactly_two_nics_on_loopback(tmp_path: Path) -> None:
    img = qemu.Image("k", tmp_path / "vmlinux", tmp_path / "initrd")
    ports = {0: (40000, 40001), 1: (40002, 40003)}
    a = qemu.GuestSpec("a", [qemu.Nic(0, 0, "198.18.1.1/24"), qemu.Nic(1, 0, "198.18.2.1/24")], "")
    b = qemu.GuestSpec("b", [qemu.Nic(0, 1, "198.18.1.2/24"), qemu.Nic(1, 1, "198.18.2.2/24")], "")
    argv_a = qemu.qemu_argv(img, a, 0, tmp_path, ports)
    argv_b = qemu.qemu_argv(img, b, 1, tmp_path, ports)
    nets_a = [x for x in argv_a if x.startswith("socket,")]
    nets_b = [x for x in argv_b if x.startswith("socket,")]
    assert nets_a == ["socket,id=n0,udp=127.0.0.1:40001,localaddr=127.0.0.1:40000",
                      "socket,id=n1,udp=127.0.0.1:40003,localaddr=127.0.0.1:40002"]
    assert nets_b == ["socket,id=n0,udp=127.0.0.1:40000,localaddr=127.0.0.1:40001",
                      "socket,id=n1,udp=127.0.0.1:40002,localaddr=127.0.0.1:40003"]
    macs = [x for x in argv_a + argv_b if "mac=" in x]
    assert len({m.split("mac=")[1] for m in macs}) == 4
    root = argv_a[argv_a.index("-virtfs") + 1]
    assert "path=/," in root and "readonly=on" in root
    assert "ks.ip=198.18.1.1/24,198.18.2.1/24" in argv_a[argv_a.index("-append") + 1]


def test_cpio_archive_lists_with_busybox(tmp_path: Path) -> None:
    if not Path(qemu.BUSYBOX).exists():
        pytest.skip("busybox-static not installed")
    data = qemu._cpio_newc([("bin", 0o40755, b""), ("bin/x", 0o100755, b"#!/bin/sh\n"),
                            ("init", 0o100755, b"abc")])
    out = subprocess.run([qemu.BUSYBOX, "cpio", "-t"], input=data, capture_output=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.decode().split() == ["bin", "bin/x", "init"]


def test_result_of_a_guest_that_never_finished(tmp_path: Path) -> None:
    (tmp_path / "a.serial").write_text("[ks-init 4.75] ready: rxe0 rxe1 \nKernel panic\n")
    spec = qemu.GuestSpec("a", [], "")
    res = qemu._result(spec, tmp_path, tmp_path / "a.serial", 9.0)
    assert res.rc == qemu.NO_STATUS and res.boot_s == 4.75 and "panic" in res.tail


def test_verbs_provider_without_devices_lists_none() -> None:
    """pyverbs raises 'Failed to get devices list' on a kernel without RDMA: that is []."""
    pytest.importorskip("pyverbs")
    if Path("/sys/class/infiniband").exists() and any(Path("/sys/class/infiniband").iterdir()):
        pytest.skip("this host has RDMA devices")
    from rdma.api import get_device_list
    from rdma.providers.verbs import get_device_list as verbs_devices

    assert verbs_devices() == []
    assert get_device_list("verbs") == []


def test_importing_rdma_never_imports_pyverbs() -> None:
    code = ("import sys, rdma, rdma.testing, rdma.vrdma; rdma.select_provider(); "
            "assert not any(m.startswith('pyverbs') for m in sys.modules), "
            "[m for m in sys.modules if m.startswith('pyverbs')]")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)
