"""``python -m rdma.vrdma.paths``: list local RDMA devices, and the paths to a peer.

Without ``--peer``: the devices of the selected provider (name, provider, IPv4, netdev)
-- what an endpoint would use as its NICs.  With ``--peer ADDR[,ADDR...] --port P`` and
the cluster secret (``--secret-file``, or ``$KSPEEDFS_SECRET`` as hex): connect a virtual
QP, let heartbeats run for ``--watch`` seconds, and print every path with its state
(``VQP.statistics()``, frozen dataclasses; ``--json`` prints them as JSON).  Exit status:
0 all paths that ever came up are UP, 1 degraded, 2 unreachable.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import asdict
from typing import TYPE_CHECKING

import trio

from ..api import get_device_list, select_provider
from ..errors import PeerUnreachable, RdmaError

if TYPE_CHECKING:
    from .vqp import VQPStats


def _secret(args: argparse.Namespace) -> bytes:
    if args.secret_file:
        with open(args.secret_file, "rb") as f:
            return f.read().strip()
    env = os.environ.get("KSPEEDFS_SECRET", "")
    if not env:
        raise SystemExit("need --secret-file or $KSPEEDFS_SECRET (hex) to talk to a peer")
    return bytes.fromhex(env)


def format_paths(stats: VQPStats) -> str:
    lines = [f"peer {stats.peer}: {stats.state}  reads_ok={stats.reads_ok} "
             f"failed_over={stats.reads_failed_over} unreachable={stats.reads_unreachable}",
             f"  {'id':>2}  {'path':<33} {'state':<10} {'reads':>8} {'hb':>6} "
             f"{'downs':>5} {'rebuild':>8}  reason"]
    for p in stats.paths:
        rb = "-" if p.last_rebuild_seconds is None else f"{p.last_rebuild_seconds * 1e3:.0f}ms"
        lines.append(f"  {p.path_id:>2}  {p.local_nic + ' -> ' + p.remote_nic:<33} "
                     f"{p.state:<10} {p.reads_ok:>8} {p.heartbeats_ok:>6} {p.downs:>5} "
                     f"{rb:>8}  {p.reason}")
    return "\n".join(lines)


async def _peer(args: argparse.Namespace) -> int:
    from .endpoint import Endpoint
    from .heartbeat import HeartbeatConfig

    cfg = HeartbeatConfig(connect_timeout=args.timeout)
    async with Endpoint(_secret(args), provider=args.provider, cfg=cfg,
                        addrs=args.local.split(",") if args.local else None) as ep:
        try:
            vqp = await ep.connect(args.peer.split(","), args.port, pairs=args.pairs)
        except PeerUnreachable as e:
            print(f"unreachable: {e.msg}", file=sys.stderr)
            return 2
        except RdmaError as e:          # AuthenticationError: wrong secret, ...
            print(f"error: {e}", file=sys.stderr)
            return 2
        await trio.sleep(args.watch)
        stats = vqp.statistics()
        if args.json:
            print(json.dumps(asdict(stats), indent=2))
        else:
            print(format_paths(stats))
        return {"reachable": 0, "degraded": 1}.get(stats.state, 2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rdma.vrdma.paths", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--provider", default=None)
    ap.add_argument("--peer", default="", help="peer NIC addresses, comma separated")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--local", default="", help="local NIC addresses to use")
    ap.add_argument("--pairs", choices=["routed", "all"], default="routed")
    ap.add_argument("--secret-file", default="")
    ap.add_argument("--watch", type=float, default=0.5)
    ap.add_argument("--timeout", type=float, default=1.0,
                    help="budget of one path build (control connection + handshake), s")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        stream=sys.stderr)
    if not args.peer:
        try:
            devs = get_device_list(args.provider)
            name = select_provider(args.provider)
        except RdmaError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        rows = [asdict(d) for d in devs]
        if args.json:
            print(json.dumps(rows, indent=2))
        else:
            print(f"provider {name}: {len(devs)} device(s)")
            for d in devs:
                print(f"  {d.name:<16} {d.ipv4 or '-':<16} {d.netdev or '-'}")
        return 0
    return trio.run(_peer, args)


if __name__ == "__main__":
    sys.exit(main())
