"""The mounts this machine serves, as their daemons describe them: what ``kspeedfs rm``
and ``gc`` keep (``cluster/lifecycle.py`` ``pinned_versions``), what ``kspeedfs status``
lists without a cluster and what ``kspeedfs stats MOUNTPOINT`` reads.

Beside each other in ``/run/kspeedfs/mounts/`` (root-only, 0700; ``fuse/upgrade.py``
names them after the mount point)::

    <name>.sock      the daemon's control socket, 0600 (fuse/upgrade.py HandoverServer):
                     a handover (native engine), {"query": true} (what it serves),
                     {"stats": true} (its read-path counters: the ``stats`` xattr's record)
    <name>.mount     its record, :class:`LocalMount` as JSON, written once the socket
                     listens and removed with it (not after a handover: the successor
                     has written its own over it)
    <name>.members   a cluster mount's last known node list (cluster/membership.py)

A record counts while its daemon lives and its mount is there (:func:`live`): the
process ``pid`` exists and started at ``pid_start`` (``/proc/<pid>/stat``), so a daemon
killed with SIGKILL, whose record stays behind, never holds a version, and neither does
a pid the kernel has since given to another process; and its mount point is a
``fuse.kspeedfs`` mount in ``/proc/self/mountinfo``, so a version is free the moment
``kspeedfs umount`` returns, not when the daemon has finished exiting (mounts are seen
from the caller's mount namespace). Both are read from /proc, not asked of the daemon:
``rm`` and ``gc`` never wait on a busy daemon. Records are never removed by
readers (a reader could remove a successor's record written meanwhile); the next daemon
at that mount point writes over a dead one's. A supervised mount whose daemon crashed
counts again once the supervisor's new daemon serves (``fuse/supervisor.py``).

Each record names the metadata store of its dataset (``manifest.store.identity``): a
dataset named ``imagenet`` in another store directory is another dataset.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import MountError
from .upgrade import FORMAT, RUN_DIR, socket_path

log = logging.getLogger(__name__)

RECORD_SUFFIX = ".mount"
RECORD_FORMAT = 1
#: the largest control-socket reply read (a cluster mount's counters name every peer)
MAX_REPLY = 1 << 20


def _start_ticks(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (``/proc/<pid>/stat``
    field 22); None when there is no such process, or it has exited and waits to be
    reaped (a zombie: where init does not reap, it may wait a long time)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat.rpartition(b")")[2].split()      # the command name may hold spaces
    try:
        return None if fields[0] == b"Z" else int(fields[19])
    except (IndexError, ValueError):
        return None


@dataclass(frozen=True)
class LocalMount:
    """One live mount of this machine, as its daemon wrote it.

    Attributes:
        mountpoint: absolute path of the mount.
        dataset, version: what it serves.
        store: the metadata store the dataset is in (``manifest.store.identity``).
        engine: ``native`` or ``pyfuse3``.
        pid, pid_start: the daemon, and when it started (clock ticks since boot).
        since: when it began serving this mount (seconds since the epoch).
    """

    mountpoint: str
    dataset: str
    version: int
    store: str
    engine: str
    pid: int
    pid_start: int
    since: float

    @property
    def tag(self) -> str:
        return f"{self.dataset}@{self.version}"

    @classmethod
    def of_this_process(cls, mountpoint: str, dataset: str, version: int, store: str,
                        engine: str) -> LocalMount:
        """The record of a mount this process serves."""
        pid = os.getpid()
        return cls(os.path.abspath(mountpoint), dataset, version, store, engine, pid,
                   _start_ticks(pid) or 0, time.time())

    def alive(self) -> bool:
        """Its daemon still runs (the same process, not one that got its pid since)."""
        return _start_ticks(self.pid) == self.pid_start

    def to_json(self) -> bytes:
        return json.dumps({"format": RECORD_FORMAT, **asdict(self)}).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> LocalMount:
        """Parse a record (root-written, but checked: ``ValueError`` for anything else)."""
        try:
            d = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise ValueError(f"not JSON: {e}") from None
        if not isinstance(d, dict) or d.get("format") != RECORD_FORMAT:
            raise ValueError("not a format-1 mount record")
        out: dict[str, Any] = {}
        for name, kind in (("mountpoint", str), ("dataset", str), ("store", str), ("engine", str),
                           ("version", int), ("pid", int), ("pid_start", int),
                           ("since", (int, float))):
            v = d.get(name)
            if not isinstance(v, kind) or isinstance(v, bool):
                raise ValueError(f"{name} is not a {getattr(kind, '__name__', 'number')}")
            out[name] = v
        return cls(**out)


def record_path(sock_path: str) -> str:
    """Where the daemon listening at ``sock_path`` keeps its record."""
    return sock_path[:-len(".sock")] + RECORD_SUFFIX if sock_path.endswith(".sock") \
        else sock_path + RECORD_SUFFIX


def publish(mount: LocalMount, path: str) -> None:
    """Write ``mount``'s record at ``path``, whole or not at all (0600; OSError)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, mount.to_json())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def withdraw(mount: LocalMount, path: str) -> None:
    """Remove the record at ``path`` if it is still ``mount``'s (a successor's stays)."""
    try:
        with open(path, "rb") as f:
            if LocalMount.from_json(f.read()).pid != mount.pid:
                return
        os.unlink(path)
    except (OSError, ValueError):
        pass


def _mounted_at(path: str, mounted: dict[str, str]) -> bool:
    """``path`` (absolute, as the daemon was given it) is a kspeedfs mount; the kernel
    lists it with the symlinks above it resolved (never the mount point itself: a stat
    of it would wait on its daemon)."""
    real = os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
    return "fuse.kspeedfs" in (mounted.get(path), mounted.get(real))


def live(store: str | None = None, run_dir: str = RUN_DIR) -> list[LocalMount]:
    """The mounts whose daemons live, of one store (``manifest.store.identity``) or of
    all, by mount point. Unreadable or malformed records are skipped (said at debug)."""
    try:
        names = sorted(n for n in os.listdir(run_dir) if n.endswith(RECORD_SUFFIX))
    except OSError:                      # none yet, or not root: no mount to see
        return []
    from ..mountpoint import mounts

    mounted = mounts()
    out = []
    for name in names:
        try:
            with open(os.path.join(run_dir, name), "rb") as f:
                mount = LocalMount.from_json(f.read(4096))
        except (OSError, ValueError) as e:
            log.debug("mount record %s skipped: %s", name, e)
            continue
        if (store is None or mount.store == store) and mount.alive() \
                and _mounted_at(mount.mountpoint, mounted):
            out.append(mount)
    return sorted(out, key=lambda m: m.mountpoint)


def ask(mountpoint: str, request: dict[str, Any], timeout: float = 5.0) -> dict[str, Any]:
    """Blocking: one request to the control socket of the daemon serving ``mountpoint``
    (``{"query": true}``, ``{"stats": true}``) and its reply. ``MountError`` with the
    reason in one line: no daemon listens, the socket is root-only, no answer in
    ``timeout`` s, or the daemon refused."""
    path = socket_path(mountpoint)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
            sock.send(json.dumps({"format": FORMAT, "mountpoint": os.path.abspath(mountpoint),
                                  **request}).encode())
            data = sock.recv(MAX_REPLY)
        except PermissionError:
            raise MountError(f"its control socket {path} is root-only") from None
        except (FileNotFoundError, ConnectionRefusedError):
            raise MountError(f"no daemon listens at its control socket {path}") from None
        except TimeoutError:
            raise MountError(f"its daemon did not answer on {path} in {timeout:g} s") from None
        except OSError as e:
            raise MountError(f"its control socket {path}: {e.strerror}") from None
    try:
        reply = json.loads(data) if data else None
    except (ValueError, RecursionError):
        reply = None
    if not isinstance(reply, dict):
        raise MountError(f"its daemon sent no readable reply on {path}")
    if "error" in reply:
        raise MountError(f"its daemon refused: {str(reply['error'])[:200]}")
    return reply
