"""The responder needs neither the GIL nor the application: a requester in another process
READs from this process's MR while this process's only Python thread hogs the GIL."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from rdma.api import ConnInfo, QPInitAttr, open_device
from rdma.testing import DEFAULT_ACCESS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: The requester: connects to the ConnInfo on stdin, says "ready", then on "go" READs
#: N times and prints how many completed OK with the right bytes, and how long it took.
REQUESTER = r"""
import json, sys, time
from rdma.api import ConnInfo, QPCap, QPInitAttr, SendWR, open_device
from rdma.enums import IBV_WR_RDMA_READ
from rdma.testing import DEFAULT_ACCESS
req = json.loads(sys.stdin.readline())
ctx = open_device("soft_lo", provider="soft")
pd, cq = ctx.alloc_pd(), ctx.create_cq(64)
mr = pd.reg_mr(1 << 16, DEFAULT_ACCESS)
qp = pd.create_qp(QPInitAttr(send_cq=cq, cap=QPCap(max_send_wr=8)))
print(json.dumps(qp.local_info().to_dict()), flush=True)
qp.connect(ConnInfo.from_dict(req["conninfo"]))
print("ready", flush=True)
sys.stdin.readline()
t0, good = time.monotonic(), 0
for i in range(200):
    qp.post_send(SendWR(wr_id=i, opcode=IBV_WR_RDMA_READ, sg_list=[mr.sge(0, 4096)],
                        remote_addr=req["addr"] + (i % 16) * 4096, rkey=req["rkey"]))
    wc = cq.poll_wait(1, 5)
    good += bool(wc and wc[0].ok and mr.read(4096) == bytes([i % 16]) * 4096)
print(json.dumps({"good": good, "seconds": time.monotonic() - t0}), flush=True)
"""


def test_responder_serves_while_this_process_hogs_the_gil() -> None:
    ctx = open_device("soft_lo", provider="soft")
    proc = subprocess.Popen([sys.executable, "-c", REQUESTER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=REPO)
    old = sys.getswitchinterval()
    try:
        pd, cq = ctx.alloc_pd(), ctx.create_cq(16)
        mr = pd.reg_mr(16 * 4096, DEFAULT_ACCESS)
        for k in range(16):
            mr.write(bytes([k]) * 4096, k * 4096)
        qp = pd.create_qp(QPInitAttr(send_cq=cq))
        assert proc.stdin and proc.stdout
        proc.stdin.write(json.dumps({"conninfo": qp.local_info().to_dict(),
                                     "addr": mr.buf, "rkey": mr.rkey}) + "\n")
        proc.stdin.flush()
        qp.connect(ConnInfo.from_dict(json.loads(proc.stdout.readline())))
        assert proc.stdout.readline().strip() == "ready"
        proc.stdin.write("go\n")
        proc.stdin.flush()
        sys.setswitchinterval(5.0)     # no other thread of ours gets the GIL for 5 s...
        end = time.monotonic() + 3.0
        spins = 0
        while time.monotonic() < end:  # ...and this one never lets go of it
            spins += 1
        sys.setswitchinterval(old)
        res = json.loads(proc.stdout.readline())
        assert res["good"] == 200, res
        assert res["seconds"] < 3.0, res  # served while we held the GIL
    finally:
        sys.setswitchinterval(old)
        proc.kill()
        proc.wait(10)
        for f in (proc.stdin, proc.stdout):
            if f:
                f.close()
        ctx.close()
