"""Where a staged volume's mount runs: outside the plugin's process, so that a plugin
restarted, upgraded or OOM-killed never takes a mount (and every pod reading it) down.

``kspeedfs mount`` already daemonizes: the daemon and its supervisor (which holds the
/dev/fuse fds and resumes a crashed daemon) run in a session of their own and outlive
the command. What differs is *whose* they are:

* :class:`ProcessStager` runs the command as a child of the plugin, in a new session.
  On a host (and in the tests) the mount's processes are then reparented to init when
  the plugin dies. In a container they would stay in the plugin pod's cgroup and die
  with it: never use it there.
* :class:`SystemdStager` asks the host's systemd (through the host's ``/run/systemd``
  mounted into the plugin's container) to run the command as a transient unit,
  ``systemd-run --unit=kspeedfs-csi-<id> --collect``: the mount's processes live in the
  host's cgroup tree, as if an administrator had mounted by hand. This is what
  Mountpoint-S3's CSI driver v1 does (it runs mount-s3 with systemd through the host's
  /run/systemd). The unit is ``Type=oneshot`` with ``RemainAfterExit=yes``: the start
  completes when ``kspeedfs mount`` exits (0 once the mount is live), and the daemon and
  supervisor it leaves stay in the unit's cgroup; a daemon that crashes and is resumed
  by its supervisor changes nothing systemd watches. ``stop`` runs after the unmount,
  when those processes have left by themselves; it only removes the unit.

  The command runs on the host, so kspeedfs must be there: installed on the host, or,
  with ``root``, the plugin image's own files copied to a host directory (the DaemonSet's
  init container does that: mount/kubernetes/csi-node.yaml) and used as the unit's
  ``RootDirectory=``, with the host's /dev, /proc and /sys (``MountAPIVFS=``) and the
  paths a mount shares with the host bound in (``BindPaths=``: kubelet's directory, where
  staging paths are; the configuration; /run/kspeedfs, where a mount's handover and
  supervisor sockets are, which an upgrade started by another unit must find; the host's
  resolv.conf and hosts, which the copied image does not have).
  ``MountFlags=shared`` sends the FUSE mount made in the unit's namespace back to the
  host's. Not run here (no systemd on the test machines): docs/kubernetes.md.

A stager's ``start`` returns once the mount is live or raises :class:`StageFailed` with
the command's own one-line error.
"""
from __future__ import annotations

import logging
import subprocess
from collections.abc import Sequence
from typing import Protocol

from .errors import CsiError

log = logging.getLogger(__name__)


class StageFailed(CsiError):
    """``kspeedfs mount`` failed; the message is its one line (INTERNAL: kubelet retries)."""


class Stager(Protocol):
    def start(self, unit: str, argv: Sequence[str], timeout: float) -> None:
        """Run ``argv`` (a daemonizing ``kspeedfs mount``) as ``unit``; return once it
        exited 0."""

    def stop(self, unit: str) -> None:
        """Forget ``unit`` once its mount is unmounted (idempotent)."""


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _run(argv: Sequence[str], timeout: float, what: str) -> None:
    try:
        proc = subprocess.run(list(argv), check=False, capture_output=True, text=True, timeout=timeout,
                              start_new_session=True, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise StageFailed(f"{what}: no answer after {timeout:.0f} s") from None
    except OSError as e:
        raise StageFailed(f"{what}: {argv[0]}: {e.strerror}") from None
    if proc.returncode != 0:
        line = _last_line(proc.stderr) or _last_line(proc.stdout) or f"exit status {proc.returncode}"
        raise StageFailed(line)


class ProcessStager:
    """The mount's processes as the plugin's children in a new session (hosts, tests)."""

    def start(self, unit: str, argv: Sequence[str], timeout: float) -> None:
        log.debug("%s: %s", unit, " ".join(argv))
        _run(argv, timeout, "kspeedfs mount")

    def stop(self, unit: str) -> None:
        pass          # the daemon and supervisor leave with the unmount


class SystemdStager:
    """The mount's processes in a transient unit of the host's systemd (a container)."""

    #: host paths a mount shares with the host when it runs in ``root``
    SHARED = ("/var/lib/kubelet", "/etc/kspeedfs", "/run/kspeedfs", "/var/log/kspeedfs")

    def __init__(self, root: str | None = None, systemd_run: str = "systemd-run",
                 systemctl: str = "systemctl") -> None:
        self.root = root
        self.systemd_run = systemd_run
        self.systemctl = systemctl

    def command(self, unit: str, argv: Sequence[str]) -> list[str]:
        rooted = [] if self.root is None else [
            f"--property=RootDirectory={self.root}", "--property=MountAPIVFS=yes",
            f"--property=BindPaths={' '.join(self.SHARED)}", "--property=MountFlags=shared",
            "--property=BindReadOnlyPaths=-/etc/resolv.conf -/etc/hosts"]   # the host's names
        return [self.systemd_run, f"--unit={unit}", "--collect", "--quiet",
                "--property=Type=oneshot", "--property=RemainAfterExit=yes", *rooted,
                "--description=kspeedfs CSI volume", "--", *argv]

    def start(self, unit: str, argv: Sequence[str], timeout: float) -> None:
        # a unit left by a failed start (--collect removes failed units, a stopped
        # RemainAfterExit one may linger) would make systemd-run refuse the name
        self.stop(unit)
        _run(self.command(unit, argv), timeout, "systemd-run")

    def stop(self, unit: str) -> None:
        subprocess.run([self.systemctl, "stop", f"{unit}.service"], check=False, capture_output=True,
                       timeout=60, stdin=subprocess.DEVNULL)


def make(kind: str, root: str | None = None) -> Stager:
    if kind == "process":
        return ProcessStager()
    if kind == "systemd":
        return SystemdStager(root)
    raise ValueError(f"unknown stager {kind!r}")
