"""The mounts a node plugin makes itself: read-only bind mounts of a staged kspeedfs
mount into pods' target paths, and their removal. (The kspeedfs mount itself is the
stager's: ``stager.py``.)

mount(2) directly, through libc: a bind mount ignores MS_RDONLY in the call that makes
it, so read-only takes a second call, MS_REMOUNT|MS_BIND|MS_RDONLY, on the new mount
alone (util-linux's ``mount --bind -o ro`` does the same two calls).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os

from .. import mountpoint

log = logging.getLogger(__name__)

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MNT_DETACH = 0x2

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def _check(result: int, what: str, path: str) -> None:
    if result != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}", path)


def bind_readonly(source: str, target: str) -> None:
    """``target`` becomes a read-only, nosuid, nodev view of the mount at ``source``."""
    _check(_libc.mount(source.encode(), target.encode(), None, MS_BIND, None), "bind mount", target)
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV
    try:
        _check(_libc.mount(b"none", target.encode(), None, flags, None), "read-only remount", target)
    except OSError:
        unmount(target)          # never leave a writable bind behind
        raise


def unmount(path: str) -> None:
    """Unmount ``path``; busy (a process still has its cwd there), detach it lazily."""
    if _libc.umount2(path.encode(), 0) == 0:
        return
    e = ctypes.get_errno()
    if e == errno.EBUSY:
        log.info("%s is busy: detached lazily", path)
        _check(_libc.umount2(path.encode(), MNT_DETACH), "lazy unmount", path)
    elif e != errno.EINVAL:      # EINVAL: not a mount point (already gone)
        raise OSError(e, f"unmount: {os.strerror(e)}", path)


def is_mounted(path: str) -> bool:
    return mountpoint.is_mounted(path)


def is_served(path: str) -> bool:
    """Mounted and answering: a FUSE mount whose daemon and supervisor are both gone is
    still in the mount table but fails every call with ENOTCONN (statfs always reaches
    the daemon)."""
    if not is_mounted(path):
        return False
    try:
        os.statvfs(path)
    except OSError:             # ENOTCONN, or ECONNABORTED/EIO while its fds close
        return False
    return True


def same_filesystem(a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` are views of one filesystem (a bind of the other)."""
    try:
        return os.stat(a).st_dev == os.stat(b).st_dev
    except OSError:
        return False
