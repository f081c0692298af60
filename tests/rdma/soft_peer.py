"""Test helpers for soft-provider tests that need a *separate process* as the peer
(SIGSTOP and SIGKILL act on processes, not threads): start ``python -m rdma.perf server``
and connect a local QP to it through its control connection.  Not a test module."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from rdma.api import CQ, MR, PD, QP, ConnInfo, Context, QPCap, QPInitAttr, open_device
from rdma.testing import DEFAULT_ACCESS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class PeerProcess:
    """``rdma.perf server`` in its own process group; killed (SIGCONT, SIGKILL) on close."""

    def __init__(self, addr: str = "127.0.0.1", mr_size: str = "4MiB",
                 argv_prefix: list[str] | None = None) -> None:
        argv = (argv_prefix or []) + [sys.executable, "-m", "rdma.perf", "server",
                                      "--provider", "soft", "--addr", addr, "--mr-size", mr_size]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, cwd=REPO, start_new_session=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if "listening on" not in line:
            self.close()
            raise RuntimeError(f"perf server did not start: {line!r} "
                               f"{self.proc.stderr.read() if self.proc.stderr else ''}")
        self.addr, port = line.split("listening on ")[1].split()[0].rsplit(":", 1)
        self.port = int(port)

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def stop(self, timeout: float = 5.0) -> None:
        """SIGSTOP, and wait until every thread really is stopped (delivery is async:
        without the wait the engine thread may still answer one more request)."""
        import glob
        import time

        self.signal(signal.SIGSTOP)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            states = []
            for path in glob.glob(f"/proc/{self.proc.pid}/task/*/stat"):
                with contextlib.suppress(OSError):
                    with open(path) as f:
                        states.append(f.read().rsplit(")", 1)[1].split()[0])
            if states and all(st in "Tt" for st in states):
                return
            time.sleep(0.002)
        raise RuntimeError("peer did not stop")

    def close(self) -> None:
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)
        self.proc.wait(10)
        for f in (self.proc.stdout, self.proc.stderr):
            if f:
                f.close()


@dataclass
class RemoteSession:
    """A local QP at RTS against a QP of the peer process, plus the peer MR to READ."""

    ctx: Context
    cq: CQ
    mr: MR
    qp: QP
    raddr: int
    rkey: int
    rlength: int
    ctl: socket.socket

    def close(self) -> None:
        self.ctl.close()
        self.ctx.close()


def connect_qp(peer: PeerProcess, pd: PD, cq: CQ, qd: int = 16,
               **connect_kw: Any) -> tuple[QP, dict[str, int], socket.socket]:
    """A new QP of ``pd`` at RTS against a new QP of the peer process: the QP, the peer
    MR to READ (``addr``, ``rkey``, ``length``) and the control connection (the peer
    keeps its QP while that is open)."""
    qp = pd.create_qp(QPInitAttr(send_cq=cq, cap=QPCap(max_send_wr=qd, max_recv_wr=16)))
    ctl = socket.create_connection((peer.addr, peer.port), timeout=10)
    try:
        ctl.sendall(json.dumps({"mode": "rdma", "qd": qd,
                                "conninfo": qp.local_info().to_dict()}).encode() + b"\n")
        rep = json.loads(ctl.makefile("rb").readline())
        qp.connect(ConnInfo.from_dict(rep["conninfo"]), **connect_kw)
    except BaseException:
        ctl.close()
        raise
    return qp, rep["mr"], ctl


@contextlib.contextmanager
def remote_session(peer: PeerProcess, local_addr: str = "127.0.0.1", mr_size: int = 1 << 20,
                   qd: int = 16, **connect_kw: Any) -> Iterator[RemoteSession]:
    ctx = open_device(provider="soft", addr=local_addr)
    try:
        pd = ctx.alloc_pd()
        cq = ctx.create_cq(4 * qd)
        mr = pd.reg_mr(mr_size, DEFAULT_ACCESS)
        qp, rmr, ctl = connect_qp(peer, pd, cq, qd, **connect_kw)
        s = RemoteSession(ctx, cq, mr, qp, rmr["addr"], rmr["rkey"], rmr["length"], ctl)
    except BaseException:
        ctx.close()
        raise
    try:
        yield s
    finally:
        s.close()
