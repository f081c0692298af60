"""READ bandwidth / message rate / latency, with a plain-TCP baseline in the same run.

Why a tool of our own (and not ib_read_bw): the soft provider has no kernel device, and the
number that matters is the *ratio* soft READ ÷ plain TCP between the same two
addresses, measured back to back so both see the same machine load::

    python -m rdma.perf server --provider soft --addr 198.18.7.2            # prints its port
    python -m rdma.perf client --provider soft --addr 198.18.7.2 --port P \\
        --size 1MiB --qd 8 --duration 5 --tcp-baseline

The server owns one MR (``--mr-size``) and, per client, one QP; a small JSON-lines control
connection swaps ConnInfo and the MR's (addr, rkey, length).  On that same control
connection a ``tcp`` request makes the server stream ``--duration`` seconds of data with
``sendall`` while the client ``recv_into``s buffers of ``--size`` bytes: one TCP stream,
one copy per side, the same work a soft READ does minus the protocol.  The two sides
touch the same memory as the READs do: the server sends ``--size`` pieces from rotating
offsets of a buffer as long as its MR, and the client fills ``--qd`` buffers in turn, as
READs land in ``--qd`` slots.  (Recycling one buffer per side kept a 1 MiB stream in
the L2 cache, while 8 READ slots of 1 MiB are not: that baseline ran 1.5× faster at
1 MiB than at 4 MiB or 128 KiB, for reasons that had nothing to do with the protocol.)

``--cq-mod N`` moderates the client's CQ (one wake-up per N completions, 100 µs cap) and
freed slots are reposted with one ``post_send`` (one request packet), as perftest's
``--cq-mod`` does; the per-READ overhead (request packet + wake-up) is what separates a
1 MiB READ stream from one TCP stream on a small VM.

The client keeps ``--qd`` READs of ``--size`` bytes in flight, each into its own slot of
its local MR, and reports bandwidth, messages/s, post→WC latency p50/p99 and the CPU
seconds per GB moved (client process, and the server process as it reports itself).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import resource
import signal
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from .api import ConnInfo, QPCap, QPInitAttr, SendWR, open_device
from .enums import IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_REMOTE_READ, IBV_SEND_SIGNALED, IBV_WR_RDMA_READ

log = logging.getLogger(__name__)

ACCESS = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 1000, "m": 1 << 20,
          "mib": 1 << 20, "mb": 1000 ** 2, "g": 1 << 30, "gib": 1 << 30, "gb": 1000 ** 3}


def parse_size(text: str) -> int:
    """``4096``, ``64KiB``, ``1MiB``, ``1M`` (binary), ``1MB`` (decimal)."""
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


def cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _send_json(sock: socket.socket, obj: dict[str, Any]) -> None:
    sock.sendall(json.dumps(obj).encode() + b"\n")


def _recv_json(f: Any) -> dict[str, Any] | None:
    line = f.readline()
    return json.loads(line) if line else None


# ------------------------------------------------------------------------- server

class Server:
    """Serves READs from one MR to any number of clients (one QP each)."""

    def __init__(self, provider: str, addr: str, port: int, mr_size: int) -> None:
        self.ctx = open_device(provider=provider, addr=addr)
        self.pd = self.ctx.alloc_pd()
        self.mr = self.pd.reg_mr(mr_size, ACCESS)
        pattern = bytes(range(256)) * 4096
        for off in range(0, mr_size, len(pattern)):
            chunk = pattern[: min(len(pattern), mr_size - off)]
            self.mr.write(chunk, off)
        self.addr = addr
        self.lsock = socket.create_server((addr, port))
        self.port = self.lsock.getsockname()[1]
        self._lock = threading.Lock()

    def serve_forever(self) -> None:
        while True:
            conn, peer = self.lsock.accept()
            threading.Thread(target=self._session, args=(conn,), daemon=True,
                             name=f"perf-session-{peer[0]}:{peer[1]}").start()

    def _session(self, conn: socket.socket) -> None:
        f = conn.makefile("rb")
        cq = qp = None
        cpu0 = cpu_seconds()
        try:
            req = _recv_json(f)
            if req is None:
                return
            if req["mode"] == "tcp":
                self._stream(conn, req["size"], req["duration"], self.mr.length)
                return
            if req["mode"] == "cpu":  # process CPU so far: the client diffs two readings
                _send_json(conn, {"cpu_s": cpu_seconds()})
                return
            with self._lock:
                cq = self.ctx.create_cq(4 * req.get("qd", 16) + 16)
                qp = self.pd.create_qp(QPInitAttr(send_cq=cq, cap=QPCap(
                    max_send_wr=max(16, req.get("qd", 16)), max_recv_wr=16)))
            remote = ConnInfo.from_dict(req["conninfo"])
            info = qp.local_info()
            qp.connect(remote)
            _send_json(conn, {"conninfo": info.to_dict(),
                              "mr": {"addr": self.mr.buf, "rkey": self.mr.rkey,
                                     "length": self.mr.length}})
            log.info("QP %#x connected to %s QP %#x", qp.qp_num, remote.ipv4, remote.qp_num)
            done = _recv_json(f)  # the client says when it is finished (or goes away)
            if done is not None:
                _send_json(conn, {"cpu_s": cpu_seconds() - cpu0})
        except (OSError, ValueError, KeyError) as exc:
            log.warning("session failed: %s", exc)
        finally:
            with self._lock:
                if qp is not None:
                    qp.close()
                if cq is not None:
                    cq.close()
            conn.close()

    @staticmethod
    def _stream(conn: socket.socket, size: int, duration: float, span: int) -> None:
        """``size`` pieces from rotating offsets of a ``span``-long buffer (as READs
        rotate over the MR) until ``duration`` has passed."""
        pieces = max(1, span // size)
        buf = memoryview(bytearray(os.urandom(1 << 16)) * (pieces * size // (1 << 16) + 1))
        end = time.monotonic() + duration
        n = 0
        try:
            while time.monotonic() < end:
                off = (n % pieces) * size
                conn.sendall(buf[off:off + size])
                n += 1
        except OSError:
            return
        conn.shutdown(socket.SHUT_WR)


def run_server(args: argparse.Namespace) -> int:
    srv = Server(args.provider, args.addr, args.port, args.mr_size)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"perf server listening on {srv.addr}:{srv.port} device {srv.ctx.name}", flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        srv.ctx.close()
    return 0


# ------------------------------------------------------------------------- client

@dataclass
class Result:
    mode: str
    size: int
    qd: int
    seconds: float
    messages: int
    bytes: int
    gbytes_per_s: float
    msgs_per_s: float
    lat_p50_us: float | None = None
    lat_p99_us: float | None = None
    client_cpu_s_per_gb: float | None = None
    server_cpu_s_per_gb: float | None = None

    def line(self) -> str:
        s = (f"{self.mode:5s} size={self.size} qd={self.qd}: {self.gbytes_per_s:.3f} GB/s "
             f"({self.gbytes_per_s * 8:.2f} Gbit/s), {self.msgs_per_s:.0f} msg/s")
        if self.lat_p50_us is not None:
            s += f", lat p50 {self.lat_p50_us:.1f} us p99 {self.lat_p99_us:.1f} us"
        if self.client_cpu_s_per_gb is not None:
            s += f", cpu/GB client {self.client_cpu_s_per_gb:.3f}s"
        if self.server_cpu_s_per_gb is not None:
            s += f" server {self.server_cpu_s_per_gb:.3f}s"
        return s


def local_addr_for(remote: str) -> str:
    """The local address the kernel would use to reach ``remote`` (no packet is sent)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect((remote, 9))
        addr: str = s.getsockname()[0]
        return addr
    finally:
        s.close()


def _pct(sorted_vals: list[float], q: float) -> float:
    return sorted_vals[min(len(sorted_vals) - 1, int(q * len(sorted_vals)))]


class ReadFailed(RuntimeError):
    """A READ completed with an error status (the WC and the time since the last good
    completion are attached, for dead-path tests)."""

    def __init__(self, wc: Any, after_s: float) -> None:
        super().__init__(f"READ failed: {wc.status.name} after {after_s:.3f}s without success")
        self.wc, self.after_s = wc, after_s


#: What the server's MR holds: byte ``o`` is ``o % 256`` (see ``Server.__init__``).
def expected_bytes(offset: int, size: int) -> bytes:
    start = offset % 256
    reps = (start + size) // 256 + 1
    return (bytes(range(256)) * reps)[start:start + size]


def server_cpu(server: str, port: int) -> float:
    """The perf server's process CPU seconds so far (same method for rdma and tcp runs)."""
    with socket.create_connection((server, port), timeout=30) as ctl:
        _send_json(ctl, {"mode": "cpu"})
        rep = _recv_json(ctl.makefile("rb"))
    return float(rep["cpu_s"]) if rep else 0.0


def run_rdma(provider: str, server: str, port: int, local: str, size: int, qd: int,
             duration: float, timeout_ms: int | None = None, retry_cnt: int | None = None,
             verify: bool = False, cq_mod: int = 1) -> Result:
    ctx = open_device(provider=provider, addr=local)
    try:
        pd = ctx.alloc_pd()
        cq = ctx.create_cq(4 * qd + 16)
        if cq_mod > 1:  # perftest's --cq-mod: one wake-up per cq_mod WCs (100 us cap)
            cq.modify(cq_mod, 100)
        mr = pd.reg_mr(size * qd, ACCESS)
        qp = pd.create_qp(QPInitAttr(send_cq=cq, cap=QPCap(max_send_wr=qd, max_recv_wr=16)))
        ctl = socket.create_connection((server, port), timeout=30)
        f = ctl.makefile("rb")
        _send_json(ctl, {"mode": "rdma", "qd": qd, "conninfo": qp.local_info().to_dict()})
        rep = _recv_json(f)
        if rep is None:
            raise RuntimeError("perf server closed the control connection")
        kw: dict[str, Any] = {} if timeout_ms is None else {"timeout_ms": timeout_ms}
        if retry_cnt is not None:
            kw["retry_cnt"] = retry_cnt
        qp.connect(ConnInfo.from_dict(rep["conninfo"]), **kw)
        raddr, rkey, rlen = rep["mr"]["addr"], rep["mr"]["rkey"], rep["mr"]["length"]
        if size > rlen:
            raise RuntimeError(f"--size {size} exceeds the server MR ({rlen})")
        slots = max(1, rlen // size)
        posted: dict[int, tuple[float, int]] = {}
        lats: list[float] = []
        n = done = 0
        wrs = [SendWR(wr_id=i, opcode=IBV_WR_RDMA_READ, sg_list=[mr.sge(i * size, size)],
                      send_flags=IBV_SEND_SIGNALED, rkey=rkey) for i in range(qd)]

        def post(free: list[int]) -> None:
            """One post_send for every freed slot: one request packet, not len(free)."""
            nonlocal n
            batch = []
            now = time.perf_counter()
            for slot in free:
                wr = SendWR(wr_id=(n << 8) | slot, opcode=IBV_WR_RDMA_READ,
                            sg_list=wrs[slot].sg_list, send_flags=IBV_SEND_SIGNALED,
                            remote_addr=raddr + (n % slots) * size, rkey=rkey)
                posted[wr.wr_id] = (now, wr.remote_addr - raddr)
                batch.append(wr)
                n += 1
            qp.post_send(batch)

        scpu0 = server_cpu(server, port)
        cpu0 = cpu_seconds()
        t0 = last_ok = time.perf_counter()
        end = t0 + duration
        post(list(range(qd)))
        while True:
            wcs = cq.poll_wait(qd, 10.0)
            if not wcs:
                raise RuntimeError("no completion in 10 s")
            now = time.perf_counter()
            free = []
            for wc in wcs:
                if not wc.ok:
                    raise ReadFailed(wc, now - last_ok)
                t_post, roff = posted.pop(wc.wr_id)
                lats.append(now - t_post)
                last_ok = now
                slot = wc.wr_id & 0xFF
                if verify and mr.read(size, slot * size) != expected_bytes(roff, size):
                    raise RuntimeError(f"READ of {size} bytes at offset {roff}: wrong data")
                done += 1
                if now < end:
                    free.append(slot)
            if free:
                post(free)
            if not posted:
                break
        elapsed = time.perf_counter() - t0
        cpu = cpu_seconds() - cpu0
        scpu = server_cpu(server, port) - scpu0
        _send_json(ctl, {"done": True})
        _recv_json(f)
        ctl.close()
        lats.sort()
        gb = done * size / 1e9
        return Result("rdma", size, qd, elapsed, done, done * size, gb / elapsed, done / elapsed,
                      _pct(lats, 0.5) * 1e6, _pct(lats, 0.99) * 1e6,
                      cpu / gb if gb else None, scpu / gb if gb else None)
    finally:
        ctx.close()


def run_tcp(server: str, port: int, size: int, duration: float, qd: int = 1) -> Result:
    """One TCP stream from the server, received into ``qd`` buffers of ``size`` in turn
    (each filled before the next, as READs fill their slots)."""
    scpu0 = server_cpu(server, port)
    ctl = socket.create_connection((server, port), timeout=30)
    try:
        _send_json(ctl, {"mode": "tcp", "size": size, "duration": duration})
        bufs = [memoryview(bytearray(size)) for _ in range(max(1, qd))]
        total = at = slot = 0
        cpu0 = cpu_seconds()
        t0 = time.perf_counter()
        while True:
            n = ctl.recv_into(bufs[slot][at:])
            if n == 0:
                break
            total += n
            at += n
            if at == size:
                at, slot = 0, (slot + 1) % len(bufs)
        elapsed = time.perf_counter() - t0
        cpu = cpu_seconds() - cpu0
    finally:
        ctl.close()
    scpu = server_cpu(server, port) - scpu0
    gb = total / 1e9
    return Result("tcp", size, len(bufs), elapsed, total // size, total, gb / elapsed,
                  total / size / elapsed, client_cpu_s_per_gb=cpu / gb if gb else None,
                  server_cpu_s_per_gb=scpu / gb if gb else None)


def run_client(args: argparse.Namespace) -> int:
    local = args.local_addr or local_addr_for(args.addr)
    results = []
    for _ in range(args.repeat):
        try:
            results.append(run_rdma(args.provider, args.addr, args.port, local, args.size,
                                    args.qd, args.duration, args.timeout_ms, args.retry_cnt,
                                    args.verify, args.cq_mod))
        except ReadFailed as exc:
            print(json.dumps({"error": exc.wc.status.name, "after_s": exc.after_s}), flush=True)
            return 3
        print(results[-1].line(), flush=True)
        if args.tcp_baseline:
            results.append(run_tcp(args.addr, args.port, args.size, args.duration, args.qd))
            print(results[-1].line(), flush=True)
    if args.tcp_baseline:
        rd = sum(r.gbytes_per_s for r in results if r.mode == "rdma")
        tc = sum(r.gbytes_per_s for r in results if r.mode == "tcp")
        print(f"ratio soft/tcp = {rd / tc:.3f}", flush=True)
    if args.json:
        print(json.dumps([asdict(r) for r in results]), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rdma.perf", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("server", help="serve READs from one MR")
    s.add_argument("--provider", default=None)
    s.add_argument("--addr", required=True, help="IPv4 of the device to serve on")
    s.add_argument("--port", type=int, default=0, help="control port (0: pick one, printed)")
    s.add_argument("--mr-size", type=parse_size, default=parse_size("64MiB"))
    c = sub.add_parser("client", help="measure READs against a server")
    c.add_argument("--provider", default=None)
    c.add_argument("--addr", required=True, help="server address")
    c.add_argument("--port", type=int, required=True, help="server control port")
    c.add_argument("--local-addr", default=None, help="local device address (default: route)")
    c.add_argument("--size", type=parse_size, default=parse_size("1MiB"))
    c.add_argument("--qd", type=int, default=8, help="READs in flight")
    c.add_argument("--duration", type=float, default=5.0)
    c.add_argument("--repeat", type=int, default=1, help="alternate rdma/tcp runs this often")
    c.add_argument("--tcp-baseline", action="store_true", help="also measure plain TCP")
    c.add_argument("--json", action="store_true", help="print the results as JSON too")
    c.add_argument("--verify", action="store_true", help="check every READ's bytes")
    c.add_argument("--timeout-ms", type=int, default=None,
                   help="per-try transport timeout (soft extension)")
    c.add_argument("--retry-cnt", type=int, default=None)
    c.add_argument("--cq-mod", type=int, default=1,
                   help="CQ moderation: wake once per N completions (as perftest --cq-mod)")
    ap.add_argument("--log-level", default="WARNING")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(message)s")
    if args.cmd == "client" and args.qd > 255:
        ap.error("--qd must be <= 255")
    return run_server(args) if args.cmd == "server" else run_client(args)


if __name__ == "__main__":
    sys.exit(main())
