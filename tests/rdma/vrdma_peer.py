"""The two ends of the vRDMA failover tests, run as real processes inside test hosts.

``serve``: an endpoint exporting ``--size`` bytes of a seeded pattern as vMR "data";
prints ``READY <port>``, then serves until SIGTERM (READs need nothing from it).

``stream``: an endpoint that connects to the server and keeps ``--qd`` READs in flight,
random offsets and lengths, checking every byte against the same pattern.  Stdout is JSON
lines the test follows: ``{"ev": "connected"}``, ``{"ev": "path", ...}`` on every path
transition, ``{"ev": "stats", ...}`` every ``--stats-every`` s, ``{"ev": "unreachable",
...}`` on PeerUnreachable (with ``--until-unreachable`` it then exits), and at the end
``{"ev": "done", ...}`` with counts and the path statistics.  Completion timestamps
(``time.monotonic()``, the same clock as the test's: one kernel) go to ``--out``.
It stops when ``--stop-file`` appears or after ``--duration`` seconds.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import sys
import time
from dataclasses import asdict

import trio

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from rdma.errors import PeerUnreachable  # noqa: E402
from rdma.vrdma import Endpoint, HeartbeatConfig  # noqa: E402


def pattern(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


def emit(obj: dict) -> None:
    obj.setdefault("t", time.monotonic())
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def make_cfg(args: argparse.Namespace) -> HeartbeatConfig:
    kw = {}
    if args.hb_interval:
        kw["interval"] = args.hb_interval
    if args.hb_misses:
        kw["miss_threshold"] = args.hb_misses
    if args.grace:
        kw["unreachable_grace"] = args.grace
    return HeartbeatConfig(**kw)


async def serve(args: argparse.Namespace) -> None:
    async with Endpoint(bytes.fromhex(args.secret), node=args.node, cfg=make_cfg(args)) as ep:
        data = ep.alloc(args.size, name="data", remote_read=True)
        data.write(pattern(args.size, args.seed))
        ep.export("data", data)
        port = await ep.listen("0.0.0.0", args.port)
        emit({"ev": "ready", "port": port, "nics": list(ep.nics)})
        print(f"READY {port}", flush=True)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as sigs:
            async for _ in sigs:
                break


async def stream(args: argparse.Namespace) -> int:
    expect = pattern(args.size, args.seed)
    rng = random.Random(os.getpid())
    done_t: list[float] = []
    lat: list[float] = []
    failures: list[str] = []
    state = {"stop": False, "reads": 0, "bytes": 0, "unreachable_at": None}

    def on_transition(t) -> None:  # noqa: ANN001
        p = vqp_box[0].paths[t.path_id] if vqp_box else None
        emit({"ev": "path", "path": t.path_id, "name": p.name if p else None,
              "old": t.old.value, "new": t.new.value, "reason": t.reason})

    vqp_box: list = []
    async with Endpoint(bytes.fromhex(args.secret), node=args.node, cfg=make_cfg(args)) as ep:
        vqp = await ep.connect(args.peer.split(","), args.port, on_transition=on_transition)
        vqp_box.append(vqp)
        rm = vqp.remote_mr("data")
        buf = ep.alloc(args.qd * args.max_len, name="landing")
        emit({"ev": "connected", "paths": [p.name for p in vqp.paths]})
        t_end = time.monotonic() + args.duration

        async def worker(i: int) -> None:
            base = i * args.max_len
            while not state["stop"]:
                n = rng.randint(args.min_len, args.max_len)
                off = rng.randrange(0, args.size - n)
                t0 = time.monotonic()
                try:
                    await vqp.read(buf, base, rm, n, remote_off=off)
                except PeerUnreachable as e:
                    if state["unreachable_at"] is None:
                        state["unreachable_at"] = time.monotonic()
                        emit({"ev": "unreachable", "msg": str(e)})
                    failures.append(f"PeerUnreachable: {e}")
                    if args.until_unreachable:
                        state["stop"] = True
                        return
                    await trio.sleep(0.05)
                    continue
                except Exception as e:  # noqa: BLE001 - the test wants every failure
                    failures.append(f"{type(e).__name__}: {e}")
                    state["stop"] = True
                    return
                t1 = time.monotonic()
                if buf.view[base:base + n] != expect[off:off + n]:
                    failures.append(f"data mismatch at remote offset {off} len {n}")
                    state["stop"] = True
                    return
                done_t.append(t1)
                lat.append(t1 - t0)
                state["reads"] += 1
                state["bytes"] += n

        async def stats() -> None:
            while not state["stop"]:
                await trio.sleep(args.stats_every)
                if args.stop_file and os.path.exists(args.stop_file):
                    state["stop"] = True
                if time.monotonic() > t_end:
                    state["stop"] = True
                s = vqp.statistics()
                emit({"ev": "stats", "reads": state["reads"], "failures": len(failures),
                      "paths": [{"name": f"{p.local_nic}->{p.remote_nic}", "state": p.state,
                                 "reads_ok": p.reads_ok, "inflight": p.inflight}
                                for p in s.paths]})

        async with trio.open_nursery() as nursery:
            for i in range(args.qd):
                nursery.start_soon(worker, i)
            nursery.start_soon(stats)
        s = vqp.statistics()
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"done_t": done_t, "lat": lat}, f)
        emit({"ev": "done", "reads": state["reads"], "bytes": state["bytes"],
              "failures": failures[:20], "n_failures": len(failures),
              "unreachable_at": state["unreachable_at"],
              "stats": {"reads_failed_over": s.reads_failed_over,
                        "paths": [asdict(p) for p in s.paths]}})
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["serve", "stream"])
    ap.add_argument("--secret", required=True, help="hex")
    ap.add_argument("--node", default=None)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--peer", default="")
    ap.add_argument("--size", type=int, default=8 << 20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--qd", type=int, default=8)
    ap.add_argument("--min-len", type=int, default=4096)
    ap.add_argument("--max-len", type=int, default=65536)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--stop-file", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--stats-every", type=float, default=0.1)
    ap.add_argument("--until-unreachable", action="store_true")
    ap.add_argument("--hb-interval", type=float, default=0.0)
    ap.add_argument("--hb-misses", type=int, default=0)
    ap.add_argument("--grace", type=float, default=0.0, help="unreachable_grace (s)")
    ap.add_argument("--log", default="WARNING")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.mode == "serve":
        trio.run(serve, args)
        return 0
    return trio.run(stream, args)


if __name__ == "__main__":
    sys.exit(main())
