"""The mount's supervisor: the FUSE connection outlives a crashed daemon.

    kspeedfs mount ─► daemon (native engine) ─ spawns ─► supervisor (this, a small process)
                          │  control socket: the daemon's fds (master + clones), its state
                          │  and a sealed copy of the manifest (manifest/sealed.py)
                          ▼
    daemon dies without saying "bye" (SIGKILL, OOM, a crash)
        the supervisor still holds every /dev/fuse fd, so the kernel connection lives and
        the requests the dead daemon had read stay queued on them (nothing is aborted)
        ─► spawns ``kspeedfs mount … --version N --manifest-fd FD --resume SOCKET``: the
           new daemon loads the manifest from the copy (no store needed), takes the fds over
           (fuse/upgrade.py, resume flavour: every fd, its threads read exactly those),
           sends FUSE_NOTIFY_RESEND (kernel 6.9+): the kernel queues again every request
           read but not answered, and the new daemon answers them. Readers see a pause.
    daemon says "bye" (unmounted, or handed over to an upgraded daemon) ─► exit 0
    supervisor dies (SIGKILL, OOM): the daemon sees its control socket close
        ─► spawns a new supervisor with the same fds, state and sealed copy (``Supervised``,
           the daemon's side), so the daemon killed later is resumed as before

Why a process of our own and not systemd's fd store: ``kspeedfs mount`` daemonizes and
is used from fstab and by hand, outside any unit; a foreground mount under systemd
(``mount/kspeedfs@.service``) is not supervised (systemd restarts it; the mount is
cleaned up and made again). Restarts are limited (``MAX_RESTARTS`` in ``RESTART_WINDOW`` s): a
daemon that keeps dying is left dead, its fds closed, so the mount fails with ENOTCONN
and the next ``kspeedfs mount`` cleans it up as it always did; so is one that cannot start
again for ``fuse.resume_patience`` seconds (60; new daemons tried 0.5 s apart, doubling
up to 8 s, each watched until it calls back or exits): its readers then get an error
instead of waiting for ever. (A resume needs no store: the manifest comes from the
supervisor's copy, so a crash during an etcd outage, or after the version was removed,
is resumed too; a cluster mount then reads from the peers its predecessor knew:
cluster/membership.py ``PrefixView.keep``.)

The argv a supervisor re-spawns daemons with carries no secret key
(``cli/mount.py`` ``_remount_argv``): a password given on the first command line reaches
the supervisor and its daemons in their environment (``spawn``, ``secrets``).

Without FUSE_NOTIFY_RESEND (kernels before 6.9) the new daemon still serves every new
request, but the requests the dead one had read stay unanswered: their readers hang
until the mount is unmounted (``kspeedfs umount -l``). The daemon logs that at ERROR.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import trio

from .. import log as logsetup
from .. import mountpoint as mp
from ..tuning import (
    CALL_TIMEOUT,
    MAX_RESTARTS,
    REAP_WAIT,
    RESTART_WINDOW,
    RESUME_BACKOFF,
    RESUME_BACKOFF_MOST,
)
from .upgrade import FD_ROOM, FORMAT, MAX_MESSAGE, RESUME_SUFFIX, fds_in, socket_path, with_fds

log = logging.getLogger("kspeedfs.supervisor")


def _recv(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """One message and the fds that came with it; ({}, []) at EOF."""
    data, anc, _, _ = sock.recvmsg(MAX_MESSAGE, FD_ROOM)
    fds = fds_in(anc)
    if not data:
        return {}, fds
    try:
        msg = json.loads(data)
    except ValueError:
        msg = {}
    return (msg if isinstance(msg, dict) else {}), fds


def _send(sock: socket.socket, msg: dict[str, Any], fds: Sequence[int] = ()) -> None:
    sock.sendmsg([json.dumps(msg).encode()], with_fds(fds))


def _one_more(times: list[float]) -> bool:
    """Record a start now in ``times`` (pruned to the last ``RESTART_WINDOW`` s); False once
    that makes more than ``MAX_RESTARTS``."""
    now = time.monotonic()
    times[:] = [t for t in times if now - t < RESTART_WINDOW] + [now]
    return len(times) <= MAX_RESTARTS


class Supervisor:
    """Holds a mount's /dev/fuse fds and restarts its daemon when it dies unannounced.

    ``control`` is the live daemon's socket; ``fds`` and ``state`` what it reported
    (the engine's master fd first); ``argv`` the ``kspeedfs`` arguments that mount it
    again (``remount``: the version it serves; ``--resume`` is added)."""

    def __init__(self, mountpoint: str, control: socket.socket, argv: list[str],
                 patience: float) -> None:
        self.mountpoint = mountpoint
        self.patience = patience                   # fuse.resume_patience
        self.control = control
        self.argv = argv
        self.fds: list[int] = []
        self.state: dict[str, Any] = {}
        self.manifest_fd: int | None = None      # a sealed copy (manifest/sealed.py)
        self.restarts: list[float] = []

    def run(self) -> int:
        while True:
            msg, fds = _recv(self.control)
            if msg.get("manifest") and len(fds) == 1:  # a message of its own: the fds
                if self.manifest_fd is not None:       # of one may number SCM_MAX_FD
                    os.close(self.manifest_fd)
                self.manifest_fd = fds[0]
                continue
            if fds:                                   # the daemon's fds: keep ours, drop old
                for fd in self.fds:
                    os.close(fd)
                self.fds, self.state = fds, msg.get("state", {})
                log.info("supervising %s: daemon pid %s, %d fds", self.mountpoint,
                         self.state.get("pid"), len(fds))
                continue
            if "state" in msg:                        # a resumed daemon reports itself
                self.state = msg["state"]
                continue
            if msg.get("bye"):
                log.info("daemon of %s ended cleanly (%s); supervisor exits", self.mountpoint,
                         msg.get("why", ""))
                return 0
            if msg:
                continue
            self.control.close()                      # EOF without bye: it died
            if not self._restart():
                return 1

    def _restart(self) -> bool:
        """Start a daemon that resumes the connection; False when giving up (the mount is
        then dead: this process exits, the fds close, readers get ENOTCONN)."""
        if not self.fds or not mp.is_mounted(self.mountpoint):
            log.warning("daemon of %s died and nothing is left to resume", self.mountpoint)
            return False
        if not _one_more(self.restarts):
            log.error("daemon of %s died %d times in %.0f s: giving up; the mount is dead "
                      "(the next kspeedfs mount cleans it up)", self.mountpoint,
                      len(self.restarts), RESTART_WINDOW)
            return False
        log.warning("daemon of %s (pid %s) died: starting a new one to resume its connection",
                    self.mountpoint, self.state.get("pid"))
        give_up, pause, tried = time.monotonic() + self.patience, RESUME_BACKOFF, 0
        while True:
            tried += 1
            if self._resume(min(CALL_TIMEOUT, max(5.0, give_up - time.monotonic()))):
                log.info("daemon of %s resumed", self.mountpoint)
                return True
            if time.monotonic() + pause >= give_up:
                break
            time.sleep(pause)
            pause = min(pause * 2, RESUME_BACKOFF_MOST)
        log.error("daemon of %s: no new daemon could resume it in %.0f s (%d tried; "
                  "fuse.resume_patience): giving up; the mount is dead (the next kspeedfs "
                  "mount cleans it up)", self.mountpoint, self.patience, tried)
        return False

    def _resume(self, call_timeout: float) -> bool:
        """One new daemon, started with ``--resume`` and handed the fds; False when it did
        not take them (it exited first, did not call in ``call_timeout`` s, or refused)."""
        path = socket_path(self.mountpoint) + RESUME_SUFFIX
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as listener:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            listener.bind(path)
            os.chmod(path, 0o600)
            listener.listen(1)
            copy = [] if self.manifest_fd is None else ["--manifest-fd", str(self.manifest_fd)]
            proc = subprocess.Popen([sys.executable, "-m", "kspeedfs.cli.app", *self.remount(),
                                     *copy, "--resume", path], stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    pass_fds=[] if self.manifest_fd is None else
                                    [self.manifest_fd])
            try:
                conn = self._call_from(listener, proc, call_timeout)
            finally:
                os.unlink(path)
        if conn is None:
            return False
        conn.settimeout(call_timeout)
        try:
            ask, _ = _recv(conn)
            if ask.get("format") != FORMAT:
                _send(conn, {"error": f"handover format {ask.get('format')!r} unknown here"})
                return self._refused(conn, proc)
            _send(conn, {"format": FORMAT, "state": self.state, "resume": True}, self.fds)
            taken, _ = _recv(conn)
            if not taken.get("taken"):
                return self._refused(conn, proc)
            _send(conn, {"done": True})
        except OSError as e:
            log.error("resuming %s: %s", self.mountpoint, e)
            return self._refused(conn, proc)
        conn.settimeout(None)
        self.control = conn                           # the new daemon's control channel
        proc.wait()                                   # its CLI parent exits once it serves
        return True

    def _refused(self, conn: socket.socket, proc: subprocess.Popen[bytes]) -> bool:
        """A new daemon that called and did not take the connection: closed, reaped (it
        exits on its own; killed after REAP_WAIT s), so no zombie is left. False."""
        conn.close()
        try:
            proc.wait(REAP_WAIT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.error("the new daemon of %s did not take the connection (status %s)",
                  self.mountpoint, proc.returncode)
        return False

    def remount(self) -> list[str]:
        """``argv`` for the version the connection serves (``--version`` last, so it wins
        over one the user gave): its inodes are that version's. Without it a daemon
        started after the dataset was imported again asked for the new current version,
        the takeover refused it, and after ``patience`` the mount was dead."""
        version = self.state.get("version")
        return [*self.argv, "--version", str(version)] if isinstance(version, int) else \
            list(self.argv)

    def _call_from(self, listener: socket.socket, proc: subprocess.Popen[bytes],
                   timeout: float) -> socket.socket | None:
        """The new daemon's call on ``listener``, or None: its CLI exited first (it
        failed: its log says why; the CLI exits only after its daemon served, which needs
        this call), or it did not call in ``timeout`` s (then killed). Why not a plain
        accept with a timeout: a daemon that cannot start (etcd, its store, its config)
        then cost 60 s per attempt, so MAX_RESTARTS in RESTART_WINDOW never tripped and the readers
        waited forever."""
        deadline = time.monotonic() + timeout
        listener.settimeout(0.2)
        while True:
            try:
                return listener.accept()[0]
            except TimeoutError:
                pass
            status = proc.poll()
            if status is not None:
                log.error("the new daemon of %s exited (status %s) before resuming it",
                          self.mountpoint, status)
                return None
            if time.monotonic() >= deadline:
                log.error("the new daemon of %s did not call in %.0f s", self.mountpoint,
                          timeout)
                proc.kill()
                proc.wait()
                return None


def spawn(mountpoint: str, fds: list[int], state: dict[str, Any], argv: list[str], logfile: str,
          patience: float, manifest_fd: int | None = None,
          secrets: dict[str, str] | None = None) -> socket.socket:
    """Start the supervisor of this daemon's mount; returns the daemon's control socket
    (send ``{"bye": true}`` on it before a clean exit). ``manifest_fd``: a sealed copy of
    the manifest (``manifest/sealed.py``) the daemons it starts load instead of the
    store's. ``secrets``: environment variables for it and the daemons it starts
    (``config.secret_environment``: secrets never travel in an argv, which every local
    user reads, while /proc/PID/environ is readable by the process's owner, root, only)."""
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    proc = subprocess.Popen([sys.executable, "-m", "kspeedfs.fuse.supervisor", "--mountpoint",
                             mountpoint, "--control", str(theirs.fileno()), "--log", logfile,
                             "--patience", str(patience), "--", *argv],
                            pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True,
                            env={**os.environ, **secrets} if secrets else None)
    theirs.close()
    try:
        _send(mine, {"state": state}, fds)
        if manifest_fd is not None:
            _send(mine, {"manifest": True}, [manifest_fd])
    except OSError:
        mine.close()
        raise
    log.info("supervisor of %s started (pid %d)", mountpoint, proc.pid)
    return mine


class Supervised:
    """The daemon's side: its supervisor's control socket, and a new supervisor when
    that one dies (``watch``), so a second fault (the daemon killed later) is survived
    as the first. The supervisor sends nothing on the socket after the handover, so its
    end of file there means it is gone (SIGKILL, OOM): the daemon, which holds the same
    /dev/fuse fds, hands them and the sealed manifest copy to a new one exactly as at
    its mount (``spawn``). Starts are limited as the supervisor limits its daemons
    (``MAX_RESTARTS`` in ``RESTART_WINDOW`` s); past that the mount serves on unsupervised.

    ``start()`` spawns a supervisor and returns its control socket (a trio socket)."""

    def __init__(self, mountpoint: str, control: trio.socket.SocketType,
                 start: Callable[[], trio.socket.SocketType]) -> None:
        self.mountpoint = mountpoint
        self.control: trio.socket.SocketType | None = control
        self.start = start
        self.starts: list[float] = []
        self.watching = trio.CancelScope()

    async def watch(self) -> None:
        """Until cancelled (``bye``): a new supervisor whenever the current one is gone."""
        with self.watching:
            while self.control is not None:
                try:
                    data = await self.control.recv(MAX_MESSAGE)
                except (OSError, trio.ClosedResourceError):
                    data = b""
                if data:
                    continue
                if self.watching.cancel_called:   # ending: ``bye`` closed it
                    return
                self.control.close()
                self.control = None
                await self._replace()

    async def _replace(self) -> None:
        pause = RESUME_BACKOFF
        while self.control is None:
            if not _one_more(self.starts):
                log.error("the supervisor of %s died %d times in %.0f s: the mount serves on "
                          "unsupervised (a crash of this daemon now ends it)", self.mountpoint,
                          len(self.starts), RESTART_WINDOW)
                return
            log.warning("the supervisor of %s is gone: starting a new one", self.mountpoint)
            try:
                self.control = self.start()
            except Exception as e:          # never worth the mount: it serves on, retried
                log.error("the supervisor of %s could not start: %s", self.mountpoint, e)
                await trio.sleep(pause)
                pause = min(pause * 2, RESUME_BACKOFF_MOST)

    async def bye(self, why: str) -> None:
        """A clean end (unmounted, or handed over): the supervisor may go; none is
        started again after it."""
        self.watching.cancel()
        if self.control is None:
            return
        try:
            await self.control.send(json.dumps({"bye": True, "why": why}).encode())
        except OSError:
            pass
        self.control.close()
        self.control = None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kspeedfs-supervisor")
    p.add_argument("--mountpoint", required=True)
    p.add_argument("--control", type=int, required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--patience", type=float, required=True)   # fuse.resume_patience
    p.add_argument("argv", nargs="*")
    args = p.parse_args(argv)
    logsetup.setup("INFO", stderr=False, file=args.log)
    control = socket.socket(fileno=args.control)
    try:
        return Supervisor(args.mountpoint, control, args.argv, args.patience).run()
    except Exception:
        log.exception("supervisor of %s failed", args.mountpoint)
        return 1


if __name__ == "__main__":
    sys.exit(main())
