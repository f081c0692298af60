"""Mountpoint checks before mounting, cleaning up after a crashed daemon, and the name of
what is named after a mount point (its log file, its handover socket).

A daemon killed with SIGKILL leaves its mount behind: every access then fails with
ENOTCONN ("Transport endpoint is not connected"). ``prepare`` recognises that state
and lazily unmounts it, so the next ``kspeedfs mount`` just works; a *live* mount is
refused instead, as are a missing or non-empty mountpoint.
"""
from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import subprocess

from .errors import MountError

log = logging.getLogger(__name__)

#: the longest file name (Linux NAME_MAX)
NAME_MAX = 255


#: a mount point whose plain name (``/`` made ``_``) is its own: no ``_``, nothing escaped
_PLAIN = re.compile(r"[A-Za-z0-9.-]+(?:/[A-Za-z0-9.-]+)*")


def name_for(mountpoint: str, room: int) -> str:
    """``mountpoint`` as one file name of at most ``room`` characters, one per mount point.

    The absolute path with each ``/`` made ``_`` (``/mnt/imagenet`` → ``mnt_imagenet``)
    when that names it alone: the path has no ``_`` and no character outside
    ``[A-Za-z0-9.-]``, and the name fits. Otherwise the path's start, every run of other
    characters made ``_``, then ``=`` and a digest of the whole path: ``/d/a_b`` and
    ``/d/a/b`` (one plain name before) get two, and no plain name has an ``=``. A mount
    point too long for the plain name used to kill its daemon at start."""
    where = os.path.abspath(mountpoint)
    inside = where.strip("/")
    if _PLAIN.fullmatch(inside) and len(inside) <= room:
        return inside.replace("/", "_")
    digest = hashlib.sha256(where.encode("utf-8", "surrogateescape")).hexdigest()[:24]
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", inside)
    return f"{readable[:max(0, room - len(digest) - 1)]}={digest}"


def shared_name_for(mountpoint: str, room: int) -> str:
    """What ``name_for`` said before it was one-to-one (daemons before 2026-12-05 listen
    there: an upgrade in place looks for them under it too). Remove once no such daemon
    runs."""
    where = os.path.abspath(mountpoint)
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", where.strip("/")) or "root"
    if len(name) > room:
        digest = hashlib.sha256(where.encode("utf-8", "surrogateescape")).hexdigest()[:24]
        name = f"{name[:max(0, room - len(digest) - 1)]}-{digest}"
    return name


def _unescape(field: str) -> str:
    # /proc/self/mountinfo escapes space, tab, newline and backslash as \ooo
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) + 1 and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mounts() -> dict[str, str]:
    """Mountpoint → filesystem type, from /proc/self/mountinfo."""
    out = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            mp = _unescape(left.split()[4])
            out[mp] = right.split()[0]
    return out


def is_mounted(path: str) -> bool:
    return os.path.realpath(path) in mounts() or os.path.abspath(path) in mounts()


def unmount(path: str, lazy: bool = False) -> None:
    cmd = ["fusermount3", "-u"] + (["-z"] if lazy else []) + [path]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise MountError(f"cannot unmount {path}: {r.stderr.strip() or r.returncode}")


def _alive(path: str) -> bool:
    """Whether the FUSE mount at ``path`` still has a daemon. ``statfs`` always goes to
    the daemon (``stat`` may be answered from the kernel's attribute cache)."""
    try:
        os.statvfs(path)
    except OSError as e:
        if e.errno == errno.ENOTCONN:
            return False
        raise
    return True


def prepare(path: str, nonempty: bool = False) -> str:
    """Validate ``path`` as a mountpoint (cleaning a dead mount); returns its absolute form."""
    path = os.path.abspath(path)
    fstype = mounts().get(path)
    if fstype is not None:
        if fstype.startswith("fuse") and not _alive(path):
            log.warning("mountpoint %s holds a dead FUSE mount (daemon gone); unmounting it", path)
            unmount(path, lazy=True)
        else:
            raise MountError(f"{path} is already a mount point ({fstype}); unmount it first")
    try:
        os.stat(path)
    except FileNotFoundError:
        raise MountError(f"mountpoint {path} does not exist") from None
    except OSError as e:
        raise MountError(f"mountpoint {path}: {e.strerror}") from None
    if not os.path.isdir(path):
        raise MountError(f"mountpoint {path} is not a directory")
    if not nonempty and os.listdir(path):
        raise MountError(f"mountpoint {path} is not empty (use -o nonempty to mount over it)")
    return path
