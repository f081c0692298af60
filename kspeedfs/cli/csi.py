"""``kspeedfs csi --endpoint unix:///csi/csi.sock --node-id NODE``: the CSI node plugin.

Stays in the foreground (a container's process, or a systemd service) and logs to
stderr. The store options (``--config``, ``--store``, ``--etcd``, ``--set``) are the
ones every ``kspeedfs mount`` it stages gets, before each volume's own settings; the
checks a mount would make run here first, so a bad configuration fails the plugin at
start, not each volume. SIGTERM/SIGINT stop serving; staged mounts stay
(``kspeedfs/csi/stager.py``): a restarted plugin finds them in ``--state-dir``, and hands
those a daemon of another kspeedfs version serves to new daemons of its own (an
upgrade: ``kspeedfs mount --upgrade``) before it serves.
"""
from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import threading

from .options import load_config, node_name

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--endpoint", default="unix:///csi/csi.sock",
                   help="the socket kubelet's registrar points at (default unix:///csi/csi.sock)")
    p.add_argument("--node-id", type=node_name, help="this node's name (default: the host name)")
    p.add_argument("--state-dir", default="/var/lib/kubelet/plugins/csi.kspeedfs.io",
                   help="the plugin's records of staged and published volumes, and inline "
                        "volumes' mounts (a host path, bidirectionally propagated)")
    p.add_argument("--stager", choices=("systemd", "process"), default="process",
                   help="run each volume's kspeedfs mount as a transient unit of the host's "
                        "systemd (in a container), or as a detached process (on a host)")
    p.add_argument("--host-root", metavar="DIR",
                   help="with --stager systemd: run mounts in this host directory holding "
                        "the plugin image's files (default: the host's own kspeedfs)")
    p.add_argument("--mount-command", metavar="PATH",
                   help="the kspeedfs command the stager runs (default: this one)")
    p.add_argument("--mount-timeout", type=float, default=300.0, metavar="S",
                   help="seconds a stage may take to mount (default 300)")


def run(args: argparse.Namespace) -> int:
    from .. import log as logsetup
    from ..config import load as load_config_file
    from ..errors import ConfigError

    cfg = load_config(args)
    logsetup.setup(cfg.log.level, stderr=True)
    if cfg.store.backend == "etcd":
        cfg.cluster.secret()          # a missing secret fails the plugin, not every volume
    from ..csi import node, server, stager
    from ..csi.errors import InvalidArgument
    from ..csi.state import StateDir
    from ..manifest.store import open_configured

    common: list[str] = []
    if args.config:
        common += ["--config", args.config]
    if args.store:
        common += ["--store", args.store]
    for url in args.etcd or []:
        common += ["--etcd", url]
    for item in args.set:
        common += ["--set", item]
    overrides = {item.partition("=")[0].strip(): item.partition("=")[2].strip() for item in args.set}

    def check_setting(key: str, value: str) -> None:
        try:
            load_config_file(args.config, {**overrides, key: value})
        except ConfigError as e:
            raise InvalidArgument(f"volume context {key}: {e}") from None

    command = [args.mount_command] if args.mount_command else [sys.executable, "-m", "kspeedfs.cli.app"]
    plugin = node.Plugin(
        node_id=args.node_id or socket.gethostname(), version=server.kspeedfs_version,
        state=StateDir(args.state_dir),
        stager=stager.make(args.stager, args.host_root), mount_command=command, common_args=common,
        open_store=lambda: open_configured(cfg), check_setting=check_setting,
        etcd=cfg.store.backend == "etcd", mount_timeout=args.mount_timeout)
    staged = list(plugin.state)
    log.info("%d volume(s) in %s: %s", len(staged), args.state_dir,
             ", ".join(f"{r.dataset}@{r.version} ({len(r.publishes)} target(s))" for r in staged)
             or "none")
    # before serving: kubelet's calls then find every mount served by this version
    if upgraded := node.upgrade_mounts(plugin):
        log.info("%d staged mount(s) handed to kspeedfs %s daemons", upgraded, plugin.version)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    srv = server.start(plugin, args.endpoint)
    stop.wait()
    log.info("stopping: staged mounts stay (%d volume(s))", len(list(plugin.state)))
    srv.stop(grace=5).wait()
    return 0
