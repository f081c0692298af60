"""``kspeedfs node --etcd URL --nic A --nic B --cache-mem 8GiB``: run this machine's node.

Stays in the foreground (run it under systemd: ``mount/kspeedfs-node.service``); logs
to stderr and to ``log.dir``/node-<name>.log. SIGTERM/SIGINT leave the cluster cleanly
(the lease is revoked, so peers re-replicate at once instead of after the TTL).
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
from typing import Any

from .options import load_config, node_name


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name", type=node_name, help="node name in the cluster (default: the host name)")
    p.add_argument("--nic", action="append", default=None, metavar="ADDR",
                   help="local NIC address to serve on (repeat per NIC; cluster.nics)")
    p.add_argument("--cache-mem", metavar="SIZE", help="memory arena size (cluster.memory)")
    p.add_argument("--cache-dir", metavar="DIR", help="SSD tier directory (cache.disk_dir)")
    p.add_argument("--cache-disk", metavar="SIZE", help="SSD tier size (cache.disk)")
    p.add_argument("--source", help="read the source from this directory instead of the recorded one")


def run(args: argparse.Namespace) -> int:
    overrides: dict[str, Any] = {"cluster.memory": args.cache_mem, "cache.disk_dir": args.cache_dir,
                                 "cache.disk": args.cache_disk}
    if args.nic:
        overrides["cluster.nics"] = args.nic
    cfg = load_config(args, **overrides)
    cfg.cluster.check_host(node=True)
    cfg.cache.check_host()
    cfg.cluster.secret()

    import trio  # after the checks: a bad flag fails fast

    from .. import log as logsetup
    from ..cluster.membership import default_node_name
    from ..cluster.node import serve

    name = args.name or default_node_name()
    log = logging.getLogger(__name__)
    logsetup.setup(cfg.log.level, stderr=True,
                   file=os.path.join(cfg.log.dir, f"node-{name}.log"))

    async def main() -> None:
        async with trio.open_nursery() as n:
            async def on_signals() -> None:
                with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as sigs:
                    async for s in sigs:
                        log.info("%s: leaving the cluster", signal.Signals(s).name)
                        n.cancel_scope.cancel()
                        return

            n.start_soon(on_signals)

            def ready(record: Any) -> None:
                print(f"node {record.node} ready: nics {','.join(record.nics)} port {record.port}",
                      flush=True)

            await serve(cfg, name, ready, args.source)

    try:
        trio.run(main)
    except BaseException as e:
        from .app import describe

        log.error("node %s failed: %s", name, describe(e)[0])   # the log file gets the reason
        log.debug("exception information:", exc_info=True)
        raise
    return 0
