"""Logging set-up for the daemon and the CLI (library modules only call getLogger).

Foreground: one line per record on stderr without timestamps (journald adds its own).
Background: a file per mount in ``log.dir``, with timestamps.

A crash that Python cannot raise (SIGSEGV, SIGILL, SIGABRT, SIGBUS, SIGFPE: in native
code, ours or gRPC's) still leaves every thread's Python stack in the log file, or on
stderr without one (``faulthandler``): a node that died inside gRPC used to leave only
its exit status.
"""
from __future__ import annotations

import faulthandler
import logging
import os
import sys

from .mountpoint import NAME_MAX, name_for

_FILE_FORMAT = "%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"
_STDERR_FORMAT = "%(levelname)s %(name)s: %(message)s"


def log_path(directory: str, dataset: str, mountpoint: str) -> str:
    """The log file of the daemon serving ``dataset`` at ``mountpoint``."""
    room = NAME_MAX - len(f"mount-{dataset}-.log")
    return os.path.join(directory, f"mount-{dataset}-{name_for(mountpoint, room)}.log")


def setup(level: str, stderr: bool = True, file: str | None = None) -> None:
    root = logging.getLogger()
    root.handlers.clear()
    root.setLevel(level.upper())
    if stderr:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter(_STDERR_FORMAT))
        root.addHandler(h)
    if file:
        os.makedirs(os.path.dirname(file), exist_ok=True)
        fh = logging.FileHandler(file)
        fh.setFormatter(logging.Formatter(_FILE_FORMAT))
        root.addHandler(fh)
        assert fh.stream is not None           # opened now (no delay=True)
        faulthandler.enable(fh.stream, all_threads=True)
    elif stderr:
        faulthandler.enable(sys.stderr, all_threads=True)
