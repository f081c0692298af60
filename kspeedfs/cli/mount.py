"""``kspeedfs mount DATASET MOUNTPOINT``: mount read-only; exits 0 once the mount is live.

Without ``--foreground`` the command forks: the child (in a new session, stdio on
/dev/null, logging to ``log.dir``) builds and serves the mount, and reports through
a pipe either "ready" or the error that stopped it; the parent prints that and exits
0 or 1. So the exit status is the truth about the mount, and a failed mount leaves
nothing behind. ``-o`` takes mount(8)-style options, which is how the mount helper
(``mount -t fuse.kspeedfs``, fstab) passes them.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError, KspeedfsError
from .options import cli_logging, dataset_name, load_config, priority, version

# -o options mount(8)/fstab pass that mean nothing to us.
_IGNORED = {"ro", "defaults", "auto", "noauto", "user", "nouser", "users", "_netdev", "nofail",
            "nosuid", "suid", "nodev", "dev", "noexec", "exec", "noatime", "relatime", "atime",
            "x-systemd.automount"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dataset", type=dataset_name)
    p.add_argument("mountpoint")
    p.add_argument("-f", "--foreground", action="store_true", help="stay attached; log to stderr too")
    p.add_argument("--version", dest="dataset_version", type=version,
                   help="mount this version (default: current)")
    p.add_argument("--source", help="read misses from this directory instead of the recorded source")
    p.add_argument("--cache-mem", metavar="SIZE", help="memory cache size (cache.memory)")
    p.add_argument("--cache-dir", metavar="DIR", help="disk cache tier directory (cache.disk_dir)")
    p.add_argument("--cache-disk", metavar="SIZE", help="disk cache tier size (cache.disk)")
    p.add_argument("--allow-other", action="store_true", default=None,
                   help="let other users access the mount")
    p.add_argument("--nonempty", action="store_true", help="allow mounting over a non-empty directory")
    p.add_argument("--upgrade", action="store_true",
                   help="take the live mount at MOUNTPOINT over from the daemon serving it, "
                        "without unmounting (same dataset and version; native engine)")
    p.add_argument("--preload", action="store_true",
                   help="also ask the cluster to hold this version (capacity-planned like "
                        "`kspeedfs preload`; etcd store)")
    p.add_argument("--unload-on-exit", action="store_true",
                   help="--preload, released when the last mount of this version goes "
                        "(a crashed mount's hold lapses with its lease)")
    p.add_argument("--priority", type=priority, default=0,
                   help="with --preload: eviction priority (higher stays; default 0)")
    p.add_argument("--resume", metavar="SOCKET", help=argparse.SUPPRESS)   # the supervisor's
    p.add_argument("--manifest-fd", type=int, help=argparse.SUPPRESS)     # ... sealed copy
    p.add_argument("-o", dest="options", metavar="OPTS", action="append", default=[],
                   help="comma-separated mount options: ro, allow_other, nonempty, preload, "
                        "unload_on_exit, priority=N, config=PATH, "
                        "version=N, source=DIR, cache_mem=SIZE, cache_dir=DIR, cache_disk=SIZE, "
                        "etcd=URL, store=DIR, SECTION.KEY=VALUE")


# -o KEY=VALUE options checked by an argparse type: key -> (attribute, type)
_TYPED = {"version": ("dataset_version", version), "priority": ("priority", priority)}


def _apply_o(args: argparse.Namespace) -> None:
    for opt in ",".join(args.options).split(","):
        opt = opt.strip()
        if not opt or opt in _IGNORED or opt.startswith("x-"):
            continue
        key, sep, value = opt.partition("=")
        if opt == "rw":
            raise ConfigError("-o rw: kspeedfs mounts are read-only")
        elif opt == "allow_other":
            args.allow_other = True
        elif opt == "nonempty":
            args.nonempty = True
        elif opt in ("preload", "unload_on_exit"):
            setattr(args, opt, True)
        elif key in ("config", "source", "store", "cache_dir") and sep:
            setattr(args, key, value)
        elif key in _TYPED and sep:
            dest, parse = _TYPED[key]
            try:
                setattr(args, dest, parse(value))
            except argparse.ArgumentTypeError as e:
                raise ConfigError(f"-o {opt}: {e}") from None
        elif key in ("cache_mem", "cache_disk") and sep:
            setattr(args, key, value)
        elif key == "etcd" and sep:
            args.etcd = (args.etcd or []) + [value]
        elif "." in key and sep:
            args.set.append(opt)
        else:
            raise ConfigError(f"-o {opt}: unknown mount option")


def run(args: argparse.Namespace) -> int:
    from .. import log as logsetup

    _apply_o(args)
    overrides: dict[str, Any] = {
        "cache.memory": args.cache_mem, "cache.disk_dir": args.cache_dir, "cache.disk": args.cache_disk,
        "fuse.allow_other": args.allow_other,
    }
    cli_logging(args)
    cfg = load_config(args, **overrides)
    cfg.cache.check_host()
    if cfg.store.backend == "etcd" and cfg.cluster.peers:
        cfg.cluster.check_host(node=False)
        cfg.cluster.secret()
    from ..daemon import MountRequest  # after the checks: a bad flag fails fast

    preload = (args.preload or args.unload_on_exit) and not (args.upgrade or args.resume)
    if preload and (cfg.store.backend != "etcd" or not cfg.cluster.peers):
        raise ConfigError("--preload/--unload-on-exit need a cluster (the etcd store, "
                          "cluster.peers on)")
    logfile = logsetup.log_path(cfg.log.dir, args.dataset, os.path.abspath(args.mountpoint))

    def request(note: Callable[[str], object]) -> MountRequest:
        """What to mount; with a preload, requested first (in the process that serves:
        ``_daemonize`` says why)."""
        if preload:
            _preload(cfg, args, note)
        return MountRequest(args.dataset, args.mountpoint, args.dataset_version, args.source,
                            args.nonempty, upgrade=args.upgrade, resume=args.resume,
                            supervise=not args.foreground, unload_on_exit=args.unload_on_exit,
                            argv=_remount_argv(sys.argv[1:]), logfile=logfile,
                            manifest_fd=args.manifest_fd if args.resume else None)

    if args.foreground:
        logsetup.setup(cfg.log.level, stderr=True, file=logfile)
        return _serve(cfg, request(lambda line: print(line, file=sys.stderr)), None)
    return _daemonize(cfg, request, logfile)


def _preload(cfg: Any, args: argparse.Namespace, note: Callable[[str], object]) -> None:
    """``--preload``/``--unload-on-exit``: request the preload before mounting, so a
    dataset that does not fit fails, in one line, with nothing mounted; ``note`` tells the
    user what was unloaded to make room."""
    from ..cluster import lifecycle
    from .options import cluster_store

    store = cluster_store(cfg, "mount --preload")
    try:
        info = store.dataset(args.dataset, args.dataset_version)
        plan, unloaded = lifecycle.request_planned(
            store, info.name, info.version, info.chunks, cfg.cluster.replicas, args.priority,
            "last-mount" if args.unload_on_exit else "manual")
    finally:
        store.close()
    for tag in unloaded:
        note(f"unloaded {tag} to make room")
    args.dataset_version = info.version           # mount exactly what was preloaded


def _remount_argv(argv: list[str]) -> tuple[str, ...]:
    """These arguments without --upgrade/--resume/--manifest-fd and without any secret
    key's value (``--set``/``-o store.etcd_password=...``): what the supervisor runs to
    mount again (in this process's working directory, which it inherits). The secrets go
    to the supervisor in its environment instead (``config.secret_environment``)."""
    from ..config import secret_keys

    secret = tuple(f"{key}=" for key in secret_keys())
    out: list[str] = []
    pending = ""                            # the option whose value is the next argument
    for a in argv:
        if pending in ("--resume", "--manifest-fd"):
            pending = ""
        elif pending == "--set":
            pending = ""
            if not a.strip().startswith(secret):
                out += ["--set", a]
        elif pending == "-o":
            pending = ""
            if kept := _without_secrets(a, secret):
                out += ["-o", kept]
        elif a in ("--resume", "--manifest-fd", "-o") or _is_set(a):
            pending = "-o" if a == "-o" else "--set" if _is_set(a) else a
        elif a.startswith("--") and "=" in a and _is_set(a.partition("=")[0]):
            if not a.partition("=")[2].strip().startswith(secret):
                out.append(a)
        elif a.startswith("-o") and not a.startswith("--"):
            if kept := _without_secrets(a[2:], secret):
                out.append("-o" + kept)
        elif a != "--upgrade" and not a.startswith(("--resume=", "--manifest-fd=")):
            out.append(a)
    return tuple(out)


def _is_set(option: str) -> bool:
    """``--set`` or an abbreviation argparse takes for it (``--se``)."""
    return len(option) >= 4 and "--set".startswith(option)


def _without_secrets(options: str, secret: tuple[str, ...]) -> str:
    """A ``-o`` value without its secret ``KEY=VALUE`` items."""
    return ",".join(o for o in options.split(",") if not o.strip().startswith(secret))


def _serve(cfg: Any, req: Any, ready: Any) -> int:
    """Serve the mount; a lone ``KspeedfsError`` raised inside the daemon's nurseries comes
    out as itself (the user's one line), not in trio's ExceptionGroup: a refused upgrade
    read "mount daemon failed: ExceptionGroup('Exceptions from Trio nursery', [...])"."""
    import trio

    from ..daemon import serve

    try:
        trio.run(serve, cfg, req, ready)
    except BaseExceptionGroup as group:
        mine, rest = group.split(KspeedfsError)
        leaves = [] if mine is None else _leaves(mine)
        if rest is None and len(leaves) == 1:
            raise leaves[0] from None
        raise
    return 0


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for e in group.exceptions:
        out.extend(_leaves(e) if isinstance(e, BaseExceptionGroup) else [e])
    return out


def _daemonize(cfg: Any, request: Callable[[Callable[[str], object]], Any], logfile: str) -> int:
    """Fork; the child makes the mount (``request``, then serve) and says "ready" or why
    not on a pipe, with the notes for the user before it; the parent prints those and
    exits. No etcd request is made before the fork: a child that used gRPC after its
    parent had (the preload's request) hung in its first call with grpcio 1.85 (forking
    with gRPC's state live is unsupported without its fork handlers, which this process
    turns off: etcd_client.py)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid:
        os.close(w)
        with os.fdopen(r, "rb") as pipe:
            msg = pipe.read().decode(errors="replace")
        while msg.startswith("note "):
            line, _, msg = msg.partition("\n")
            print(line[5:], file=sys.stderr)
        if msg.startswith("ready "):
            return 0
        if not msg:
            _, status = os.waitpid(pid, 0)
            msg = f"the mount daemon died (status {status}); see {logfile}"
        raise _ChildError(msg)
    # child
    os.close(r)
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    from .. import log as logsetup

    logsetup.setup(cfg.log.level, stderr=False, file=logfile)
    status = 1

    def ready(path: str) -> None:
        os.write(w, f"ready {path}".encode())
        os.close(w)

    try:
        status = _serve(cfg, request(lambda line: os.write(w, f"note {line}\n".encode())), ready)
    except KspeedfsError as e:
        try:
            os.write(w, str(e).encode())
        except OSError:
            pass
    except BaseException as e:  # a bug: keep the traceback in the log
        import logging

        logging.getLogger(__name__).exception("mount daemon failed")
        try:
            os.write(w, f"mount daemon failed: {e!r}; see {logfile}".encode())
        except OSError:
            pass
    finally:
        logging_shutdown()
        os._exit(status)


def logging_shutdown() -> None:
    import logging

    logging.shutdown()


class _ChildError(KspeedfsError):
    pass


if __name__ == "__main__":
    sys.exit(1)
