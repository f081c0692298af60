"""Handing a live FUSE connection to a new mount daemon (``kspeedfs mount --upgrade``),
over the control socket every mount daemon listens at (root-only), which also answers
what it serves (``{"query": true}``) and its counters (``{"stats": true}``, read by
``kspeedfs stats`` and ``status``: ``fuse/registry.py``).

    new daemon                                   old daemon (native engine)
    connect  /run/kspeedfs/mounts/<slug>.sock ─► listening since its mount
    {"format": 1, "dataset", "version",       ─►  refused unless it serves that dataset
     "mountpoint"}                                version at that mount point
                                              ◄─ {"format": 1, "state": {...}} + the /dev/fuse fd
    adopt the state, start its C threads          (SCM_RIGHTS: the same open connection)
    {"taken": true}                           ─►  stop its C threads (each finishes the
                                                  request it holds), answer its queued misses
                                              ◄─ {"done": true}, then exit without unmounting

Both daemons serve the same immutable snapshot, so for the moment both read the
connection every request is answered correctly by whichever reads it; the kernel never
sees the connection without a reader, so readers see a pause at most (no INIT is sent
again: the new engine adopts the old one's INIT results). File handles the old daemon
gave out are unknown to the new one (the engine validates every fh; an unknown one
reads as a handle without sequential history), and the new daemon's memory tier starts
empty: the first reads after an upgrade are misses served by the peers or the source.

The state is JSON, versioned by ``format``: a daemon refuses a format it does not know
(the old one keeps serving), and refuses a different dataset or version than it serves
(the kernel caches the old version's inodes and pages), and another mount point than its
own (an asker older than the field is taken at its word). Each mount point has its own
socket name (``mountpoint.name_for``); daemons from before that listen at a name two
mount points could share (``/d/a_b``, ``/d/a/b``), and the new daemon asks there too.

Format 1 ``state``: ``dataset``, ``version``, ``minor`` (FUSE protocol minor),
``flags`` (negotiated INIT flags, 64-bit), ``max_pages``, ``max_readahead``,
``connection`` (the fusectl connection number), ``pid`` (the old daemon), ``transport``
("/dev/fuse"; a daemon serving "io_uring" refuses to hand over: fuse/native.py).
"""
from __future__ import annotations

import array
import json
import logging
import os
import socket
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import trio

from ..errors import MountError
from ..mountpoint import name_for, shared_name_for

if TYPE_CHECKING:
    from .registry import LocalMount

log = logging.getLogger(__name__)

FORMAT = 1
RUN_DIR = "/run/kspeedfs/mounts"
MAX_MESSAGE = 64 << 10

#: the longest AF_UNIX path (``sun_path`` is 108 bytes with its NUL), and what the
#: supervisor puts after a mount's socket name for its own, resume, socket
SUN_PATH_MAX = 107
RESUME_SUFFIX = ".resume"


def socket_path(mountpoint: str, *, shared: bool = False) -> str:
    """The handover socket of the daemon serving ``mountpoint``, named after it (one name
    per mount point) within an AF_UNIX address (with the supervisor's suffix); ``shared``:
    the name daemons before that listened at (``mountpoint.shared_name_for``)."""
    room = SUN_PATH_MAX - len(RESUME_SUFFIX) - len(RUN_DIR) - len("/.sock")
    name = shared_name_for(mountpoint, room) if shared else name_for(mountpoint, room)
    return os.path.join(RUN_DIR, f"{name}.sock")


def members_path(mountpoint: str) -> str:
    """Where the daemon serving ``mountpoint`` keeps the cluster's last known node list
    for the daemon that takes the mount over (cluster/membership.py ``PrefixView.keep``)."""
    return socket_path(mountpoint)[:-len(".sock")] + ".members"


def _message(data: bytes) -> dict[str, Any]:
    """A handover message: one JSON object (``MountError`` for anything else)."""
    try:
        msg = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise MountError(f"upgrade: unreadable handover message: {e}") from None
    if not isinstance(msg, dict):
        raise MountError("upgrade: handover message is not an object")
    return msg


#: the fds one SCM_RIGHTS message may carry (the kernel's SCM_MAX_FD): a connection's fds
#: (one per request thread) go to a successor in one message, so that many threads at most
MAX_FDS = 253
#: room for the fds of one message
FD_ROOM = socket.CMSG_SPACE(4 * MAX_FDS)


def fds_in(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    """The fds an SCM_RIGHTS message carried (they are open in this process now)."""
    fds: list[int] = []
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            a = array.array("i")
            a.frombytes(payload[:len(payload) - len(payload) % a.itemsize])
            fds.extend(a)
    return fds


def with_fds(fds: Sequence[int]) -> list[tuple[int, int, array.array[int]]]:
    """The ancillary data that passes ``fds`` (none: an empty list)."""
    return [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []


async def _recv(sock: trio.socket.SocketType, timeout: float) -> tuple[dict[str, Any], list[int]]:
    with trio.fail_after(timeout):
        data, anc, _, _ = await sock.recvmsg(MAX_MESSAGE, FD_ROOM)
    fds = fds_in(anc)
    if not data:
        for fd in fds:
            os.close(fd)
        raise MountError("upgrade: the other daemon closed the handover")
    return _message(data), fds


async def _send(sock: trio.socket.SocketType, msg: dict[str, Any], fds: Sequence[int] = ()) -> None:
    await sock.sendmsg([json.dumps(msg).encode()], with_fds(fds))


# -- the new daemon ------------------------------------------------------------------------

async def _connect(paths: list[str], mountpoint: str) -> trio.socket.SocketType:
    """A handover connection to the first of ``paths`` a daemon listens at (the error
    names the first: the others are older daemons' names)."""
    why = ""
    for path in paths:
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            await sock.connect(path)
            return sock
        except OSError as e:
            sock.close()
            why = why or f"{path}: {e.strerror}"
    raise MountError(f"upgrade: no kspeedfs daemon to take {mountpoint} over from ({why})")


def _socket_paths(mountpoint: str) -> list[str]:
    """Where a daemon serving ``mountpoint`` listens: its own name, then the name daemons
    from before the names were one-to-one shared (when that differs)."""
    return list(dict.fromkeys((socket_path(mountpoint), socket_path(mountpoint, shared=True))))


async def served(mountpoint: str, timeout: float = 10.0) -> tuple[str, int] | None:
    """The dataset and version the daemon serving ``mountpoint`` serves, asked over its
    handover socket (nothing is handed over); None when none answers the question (none
    listens, or a daemon from before the question, which answers it with an error)."""
    try:
        sock = await _connect(_socket_paths(mountpoint), mountpoint)
    except MountError:
        return None
    with sock:
        try:
            await _send(sock, {"format": FORMAT, "query": True,
                               "mountpoint": os.path.abspath(mountpoint)})
            reply, fds = await _recv(sock, timeout)
        except (MountError, OSError, trio.TooSlowError):
            return None
    for fd in fds:
        os.close(fd)
    dataset, version = reply.get("dataset"), reply.get("version")
    if isinstance(dataset, str) and isinstance(version, int) and not isinstance(version, bool):
        return dataset, version
    return None


async def take_over(mountpoint: str, dataset: str, version: int,
                    adopt: Callable[[list[int], dict[str, Any], bool], None], *,
                    path: str | None = None, timeout: float = 10.0) -> trio.socket.SocketType:
    """Ask the daemon serving ``mountpoint`` (or the supervisor listening at ``path``,
    after a crash) for its connection; ``adopt(fds, state, resume)`` must start serving
    it (blocking, run in a thread); returns once the old daemon has stopped reading, with
    the socket (a supervisor's: the new daemon's control channel; else just close it).
    ``MountError`` (the old daemon keeps serving) if anything is off."""
    sock = await _connect([path] if path else _socket_paths(mountpoint), mountpoint)
    try:
        await _send(sock, {"format": FORMAT, "dataset": dataset, "version": version,
                           "mountpoint": os.path.abspath(mountpoint)})
        reply, fds = await _recv(sock, timeout)
        if "error" in reply or reply.get("format") != FORMAT or not fds:
            for fd in fds:
                os.close(fd)
            why = reply.get("error") or f"format {reply.get('format')!r} with {len(fds)} fds"
            raise MountError(f"upgrade refused by the serving daemon: {why}")
        state = reply.get("state")
        resume = bool(reply.get("resume"))
        if not isinstance(state, dict):
            state = {}
        if (state.get("dataset"), state.get("version")) != (dataset, version):
            for fd in fds:
                os.close(fd)
            raise MountError(f"upgrade: the connection serves {state.get('dataset')}@"
                             f"{state.get('version')}, not {dataset}@{version}")
        await trio.to_thread.run_sync(adopt, fds, state, resume)    # the fds are its now
        await _send(sock, {"taken": True})
        done, _ = await _recv(sock, timeout)
        log.info("%s: took %s over from %s (%s)", "resume" if resume else "upgrade", mountpoint,
                 "the supervisor" if resume else f"pid {state.get('pid')}",
                 "it stopped" if done.get("done") else done)
        return sock
    except BaseException:
        sock.close()
        raise


# -- the old daemon ------------------------------------------------------------------------

class HandoverServer:
    """The serving daemon's side: listens on ``socket_path(mountpoint)`` and hands the
    connection over once (``state()`` and ``fd`` describe it; ``stop()`` ends this
    daemon's reading, blocking, run in a thread). ``handed_over`` is set when the
    successor took it; the caller then exits without unmounting. ``stats()``: the
    counters a ``stats`` request gets; ``record``: this mount's entry in the registry
    of local mounts (``fuse/registry.py``), kept beside the socket while it listens. A
    ``state()`` whose ``transport`` is ``pyfuse3`` refuses every handover."""

    def __init__(self, mountpoint: str, dataset: str, version: int, fd: int,
                 state: Callable[[], dict[str, Any]], stop: Callable[[], Awaitable[None]], *,
                 stats: Callable[[], dict[str, Any]] | None = None,
                 record: LocalMount | None = None) -> None:
        self.path = socket_path(mountpoint)
        self.mountpoint = os.path.abspath(mountpoint)
        self.dataset = dataset
        self.version = version
        self.fd = fd
        self.state = state
        self.stop = stop
        self.stats = stats
        self.record = record
        self.handed_over = trio.Event()

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listener = trio.socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with listener:
            try:
                os.makedirs(RUN_DIR, mode=0o700, exist_ok=True)
                try:
                    os.unlink(self.path)  # a dead predecessor's; a live one was handed over
                except FileNotFoundError:
                    pass
                await listener.bind(self.path)
                os.chmod(self.path, 0o600)
                listener.listen(4)
            except OSError as e:          # the mount serves on; only its upgrades are lost
                log.warning("upgrade: no handover socket at %s (%s): this mount cannot be "
                            "upgraded in place, nor seen by `kspeedfs rm`, `status` and "
                            "`stats` (without fuse.xattrs)", self.path, e)
                task_status.started()
                return
            self._publish()
            task_status.started()
            try:
                while not self.handed_over.is_set():
                    conn, _ = await listener.accept()
                    with conn:
                        try:
                            await self._serve_one(conn)
                        except (MountError, OSError, trio.TooSlowError) as e:
                            log.warning("upgrade: handover not done: %s", e)
            finally:
                if not self.handed_over.is_set():
                    with trio.CancelScope(shield=True):
                        try:
                            os.unlink(self.path)
                        except OSError:
                            pass
                        if self.record is not None:
                            from . import registry
                            registry.withdraw(self.record, registry.record_path(self.path))

    def _publish(self) -> None:
        """This mount's record beside its socket (a failure costs only its listing)."""
        if self.record is None:
            return
        from . import registry
        try:
            registry.publish(self.record, registry.record_path(self.path))
        except OSError as e:
            log.warning("no mount record beside %s (%s): `kspeedfs rm` and `status` do not "
                        "see this mount", self.path, e)

    async def _serve_one(self, conn: trio.socket.SocketType) -> None:
        ask, fds = await _recv(conn, 10.0)
        for fd in fds:
            os.close(fd)
        if ask.get("format") != FORMAT:
            await _send(conn, {"error": f"handover format {ask.get('format')!r} unknown here "
                                        f"(this daemon speaks {FORMAT})"})
            return
        asked = ask.get("mountpoint", self.mountpoint)      # (older askers do not send it)
        if asked != self.mountpoint:                # an older daemon's shared name
            await _send(conn, {"error": f"this daemon serves {self.mountpoint}, "
                                        f"not {str(asked)[:4096]}"})
            return
        if ask.get("query"):                        # ``served``: what, not the connection
            await _send(conn, {"format": FORMAT, "dataset": self.dataset,
                               "version": self.version})
            return
        if ask.get("stats"):                        # ``kspeedfs stats``: the counters
            await _send(conn, {"format": FORMAT, "stats": self.stats()} if self.stats
                        else {"error": "this daemon keeps no counters"})
            return
        if (ask.get("dataset"), ask.get("version")) != (self.dataset, self.version):
            await _send(conn, {"error": f"this mount serves {self.dataset}@{self.version}, not "
                                        f"{ask.get('dataset')}@{ask.get('version')}"})
            return
        state = self.state()
        if state.get("transport") == "pyfuse3":
            await _send(conn, {"error": "this mount is served by the pyfuse3 engine, which "
                                        "cannot hand its connection over; unmount and mount "
                                        "again (fuse.engine=native to make it upgradable)"})
            return
        if state.get("transport") == "io_uring":     # fuse/native.py RING_LIFECYCLE
            await _send(conn, {"error": "this mount is served over io_uring queues, which the "
                                        "kernel cannot hand to another process; unmount and "
                                        "mount again (fuse.io_uring=off to make it upgradable)"})
            return
        await _send(conn, {"format": FORMAT, "state": state}, [self.fd])
        taken, _ = await _recv(conn, 30.0)
        if not taken.get("taken"):
            return
        log.info("upgrade: a successor serves this mount; stopping")
        self.handed_over.set()
        await self.stop()
        await _send(conn, {"done": True})
