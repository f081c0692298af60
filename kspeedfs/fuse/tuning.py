"""Kernel knobs pyfuse3 cannot negotiate, set through sysfs once the mount is live.

- ``/sys/fs/fuse/connections/<N>/max_background`` (kernel default 12): how many
  asynchronous requests (readahead, async direct I/O) the kernel keeps outstanding
  to the daemon. With prefetch and many readers the daemon can overlap far more than
  12 chunk loads; 64 keeps the single trio loop busy without unbounded queues.
- ``.../congestion_threshold`` (default 3/4 of max_background): past it the kernel
  marks the bdi congested and stops issuing readahead.
- ``/sys/class/bdi/0:<N>/read_ahead_kb`` (default 128): the kernel's readahead window.
  4 MiB turns a sequential 128 KiB reader into 1 MiB FUSE requests issued ahead.

The connection knobs live in the ``fusectl`` filesystem; where it is not mounted yet
(a fresh container, a minimal host) and we are root, it is mounted first.

``N`` is the mount's anonymous device minor (``st_dev`` of the mountpoint). Must run
while the FUSE loop is serving (the ``stat`` goes through the daemon), so the daemon
calls it from a worker thread after ``pyfuse3.init``.
"""
from __future__ import annotations

import logging
import os
import subprocess
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KernelKnobs:
    max_background: int
    congestion_threshold: int
    read_ahead_kb: int


def _write(path: str, value: int) -> bool:
    try:
        with open(path, "w") as f:
            f.write(str(value))
        return True
    except OSError as e:
        log.warning("cannot set %s = %d: %s", path, value, e.strerror)
        return False


FUSECTL = "/sys/fs/fuse/connections"


def _ensure_fusectl(conn: str) -> None:
    if os.path.isdir(conn) or not os.path.isdir(FUSECTL) or os.listdir(FUSECTL):
        return
    r = subprocess.run(["mount", "-t", "fusectl", "fusectl", FUSECTL], capture_output=True, text=True)
    if r.returncode:
        log.warning("cannot mount fusectl on %s: %s", FUSECTL, r.stderr.strip())


def apply(mountpoint: str, knobs: KernelKnobs) -> dict[str, int]:
    """Set the knobs for the mount at ``mountpoint``; returns what is now in force."""
    minor = os.minor(os.stat(mountpoint).st_dev)
    conn = f"{FUSECTL}/{minor}"
    _ensure_fusectl(conn)
    bdi = f"/sys/class/bdi/0:{minor}"
    # max_background first: the kernel caps congestion_threshold by nothing, but a
    # threshold above max_background is meaningless.
    _write(f"{conn}/max_background", knobs.max_background)
    _write(f"{conn}/congestion_threshold", knobs.congestion_threshold)
    _write(f"{bdi}/read_ahead_kb", knobs.read_ahead_kb)
    now = {}
    for key, path in (("max_background", f"{conn}/max_background"),
                      ("congestion_threshold", f"{conn}/congestion_threshold"),
                      ("read_ahead_kb", f"{bdi}/read_ahead_kb")):
        try:
            with open(path) as f:
                now[key] = int(f.read())
        except (OSError, ValueError):
            pass
    log.info("kernel knobs for %s (connection %d): %s", mountpoint, minor, now)
    return now
