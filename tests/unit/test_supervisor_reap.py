"""The supervisor reaps a new daemon that called back and did not take the connection
(fuse/supervisor.py ``Supervisor._refused``): it leaves no zombie, and one that does not
exit is killed."""
from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from kspeedfs.fuse import supervisor
from kspeedfs.fuse.supervisor import Supervisor


def _refuse(cmd: list[str]) -> tuple[subprocess.Popen, float]:
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sup = Supervisor("/nowhere", mine, ["mount", "ds", "/nowhere"], patience=1.0)
    proc = subprocess.Popen(cmd)
    t0 = time.monotonic()
    try:
        assert sup._refused(theirs, proc) is False
    finally:
        mine.close()
    return proc, time.monotonic() - t0


def test_a_daemon_that_refused_and_exits_is_reaped() -> None:
    proc, _ = _refuse([sys.executable, "-c", "raise SystemExit(3)"])
    assert proc.returncode == 3                       # waited for: not a zombie


def test_a_daemon_that_refused_and_stays_is_killed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervisor, "REAP_WAIT", 0.3)
    proc, took = _refuse(["sleep", "30"])
    assert proc.returncode == -9 and took < 5, (proc.returncode, took)
