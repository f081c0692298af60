"""The grant socket: a process on the node's host maps a dataset's arena segments.

A library process on the node's host reads chunks straight from the node's memory
instead of over loopback vRDMA (``docs/design.md``, "Zero-copy on the node's host"). The
node listens on an ``AF_UNIX`` ``SOCK_SEQPACKET`` socket (``cluster.grant_socket``,
mode 0666 in a root-owned 0755 directory); who may read what is decided per connection
from ``SO_PEERCRED`` (uid, gid, pid) and the peer's supplementary groups (at connect
time: ``SO_PEERGROUPS``, else ``/proc/<pid>/status``) against ``cluster.host_readers``.

Protocol: one JSON object a datagram, at most 64 KiB, ``"v": 1``::

    → {"v":1,"op":"grant","dataset":"D"}
    ← {"ok":true,"slot_size":S,"segment_bytes":B,"segments":[i,...]}  + one read-only
      fd per listed segment (SCM_RIGHTS, same order); segment i is bytes
      [i·B, i·B + its length) of the arena, slot s at s·S as peers READ it
    → {"v":1,"op":"locate","keys":["<32 hex>",...]}         (at most 1024 keys)
    ← {"ok":true,"slots":[[slot,length] | null,...],"segments":[new i,...]} + their fds
    ← {"ok":false,"errno":"EACCES","message":"one line"}      (any refusal)

A connection holds at most one grant; ``locate`` answers a key only when it is held in
a segment the granted dataset owns (``Arena.locate``), and sends the fds of the
dataset's segments this connection has not received yet (at most ``FDS_PER_REPLY`` a
reply: SCM_RIGHTS carries 253; the rest come with the next ``locate``). A segment
handed out is pinned to its dataset (``Arena.pin``): a mapping cannot be taken back.
Bytes read from a slot are verified against the key by the reader (a slot is reused
after an eviction, as for a peer's READ).

Parsing is pure (:func:`parse_request`, :func:`allows`, :func:`answer`) and fuzzed;
the server (:func:`serve`) only moves datagrams and fds, bounds its connections
(``MAX_CONNECTIONS``; an idle one is closed after ``IDLE``) and never lets a peer's
error escape its task.
"""
from __future__ import annotations

import array
import errno
import grp
import json
import logging
import os
import pwd
import socket
import stat
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import trio

from ..errors import GrantRefused, UnsafePath
from .arena import Arena
from .arena_segments import SegmentMemory

log = logging.getLogger(__name__)

VERSION = 1
MAX_MESSAGE = 64 << 10
MAX_KEYS = 1024
FDS_PER_REPLY = 250                # SCM_MAX_FD is 253
MAX_CONNECTIONS = 128
IDLE = 300.0                       # s without a request: the connection is closed
_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)


@dataclass(frozen=True)
class Peer:
    """Who is on the other end: ``SO_PEERCRED`` at connect time, and its groups."""

    pid: int
    uid: int
    gid: int
    groups: frozenset[int] = frozenset()


@dataclass(frozen=True)
class GrantRequest:
    dataset: str


@dataclass(frozen=True)
class LocateRequest:
    keys: list[bytes]


@dataclass
class Connection:
    """One connection's state: its grant (a dataset, once) and the segments it has."""

    peer: Peer
    dataset: str | None = None
    sent: set[int] = field(default_factory=set)


def _refuse(code: int, message: str) -> GrantRefused:
    return GrantRefused(message, errno=code)


def parse_request(raw: bytes) -> GrantRequest | LocateRequest:
    """One datagram → a request; :class:`GrantRefused` (EINVAL) for anything else."""
    if len(raw) > MAX_MESSAGE:
        raise _refuse(errno.EMSGSIZE, f"a request is at most {MAX_MESSAGE} bytes")
    try:
        msg = json.loads(raw)
    except (ValueError, RecursionError):
        raise _refuse(errno.EINVAL, "a request is one JSON object") from None
    if not isinstance(msg, dict) or msg.get("v") != VERSION or isinstance(msg.get("v"), bool):
        raise _refuse(errno.EINVAL, f"a request is a JSON object with \"v\": {VERSION}")
    op = msg.get("op")
    if op == "grant":
        dataset = msg.get("dataset")
        if not isinstance(dataset, str) or not 0 < len(dataset) <= 255:
            raise _refuse(errno.EINVAL, "grant needs \"dataset\": a name")
        return GrantRequest(dataset)
    if op == "locate":
        keys = msg.get("keys")
        if not isinstance(keys, list) or len(keys) > MAX_KEYS:
            raise _refuse(errno.EINVAL, f"locate needs \"keys\": a list of at most {MAX_KEYS}")
        return LocateRequest([_key(k) for k in keys])
    raise _refuse(errno.EINVAL, f"unknown op {str(op)[:40]!r}: grant or locate")


def _key(k: object) -> bytes:
    if not isinstance(k, str) or len(k) != 32:
        raise _refuse(errno.EINVAL, "a key is 32 hex digits (xxh3-128 of the chunk)")
    try:
        return bytes.fromhex(k)
    except ValueError:
        raise _refuse(errno.EINVAL, "a key is 32 hex digits (xxh3-128 of the chunk)") from None


def _named(principal: str) -> int | None:
    """The uid of ``user:NAME`` or gid of ``group:NAME``; None when there is none."""
    kind, _, name = principal.partition(":")
    try:
        return pwd.getpwnam(name).pw_uid if kind == "user" else grp.getgrnam(name).gr_gid
    except KeyError:
        return None


def allows(principals: list[str], peer: Peer,
           resolve: Callable[[str], int | None] = _named) -> bool:
    """Whether ``peer`` is one of ``principals`` (``cluster.host_readers``); root always."""
    if peer.uid == 0 or "*" in principals:
        return True
    return any(_matches(p, peer, resolve) for p in principals)


def _matches(principal: str, peer: Peer, resolve: Callable[[str], int | None]) -> bool:
    kind, _, value = principal.partition(":")
    gids = peer.groups | {peer.gid}
    if kind in ("uid", "gid"):
        wanted: int | None = int(value) if value.isdigit() else None
    else:
        wanted = resolve(principal)
    if wanted is None:
        return False
    return wanted == peer.uid if kind in ("uid", "user") else wanted in gids


def error_reply(e: GrantRefused) -> dict[str, Any]:
    return {"ok": False, "errno": errno.errorcode.get(e.errno, "EIO"),
            "message": " ".join(str(e).split())[:200]}


def _new_segments(arena: Arena, conn: Connection, first: list[int]) -> list[int]:
    """Segments of the grant ``conn`` has not received: those of ``first`` (the slots
    just located) first, at most ``FDS_PER_REPLY``."""
    owned = arena.segments(conn.dataset)
    new = [s for s in dict.fromkeys(first + owned) if s not in conn.sent and s in owned]
    return new[:FDS_PER_REPLY]


def answer(arena: Arena, readers: Mapping[str, list[str]], conn: Connection, raw: bytes,
           resolve: Callable[[str], int | None] = _named) -> tuple[dict[str, Any], list[int]]:
    """The reply to one datagram, and the segments whose fds go with it (in order);
    updates ``conn``. Never raises for a peer's input: a refusal is a reply."""
    try:
        req = parse_request(raw)
        if isinstance(req, GrantRequest):
            if conn.dataset is not None:
                raise _refuse(errno.EALREADY, f"this connection holds the grant of "
                              f"{conn.dataset}: one a connection")
            if not allows(readers.get(req.dataset, []), conn.peer, resolve):
                raise _refuse(errno.EACCES, f"uid {conn.peer.uid} may not read {req.dataset} "
                              "on this host (cluster.host_readers)")
            conn.dataset = req.dataset
            segs = _new_segments(arena, conn, [])
            return {"ok": True, "slot_size": arena.g.slot_size,
                    "segment_bytes": arena.g.segment_bytes, "segments": segs}, segs
        if conn.dataset is None:
            raise _refuse(errno.ENOENT, "locate before grant")
        slots = [arena.locate(k, conn.dataset) for k in req.keys]
        per = arena.g.per_segment
        segs = _new_segments(arena, conn, [s[0] // per for s in slots if s is not None])
        return {"ok": True, "slots": [list(s) if s else None for s in slots],
                "segments": segs}, segs
    except GrantRefused as e:
        return error_reply(e), []


def peer_of(sock: socket.socket | trio.socket.SocketType) -> Peer:
    """The peer's credentials at connect time, with its supplementary groups."""
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                        struct.calcsize("3i")))
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, 1024)
        groups = frozenset(array.array("I", raw[:len(raw) // 4 * 4]))
    except OSError:                    # more than 256 groups, or an old kernel
        groups = proc_groups(pid)
    return Peer(pid, uid, gid, groups)


def proc_groups(pid: int) -> frozenset[int]:
    """The ``Groups:`` of ``/proc/<pid>/status`` (none when it cannot be read)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return frozenset(int(g) for g in line.split()[1:])
    except (OSError, ValueError):
        pass
    return frozenset()


def socket_path(template: str, cluster: str, node: str) -> str:
    """``cluster.grant_socket`` with ``{cluster}`` and ``{node}`` filled in."""
    return template.replace("{cluster}", cluster).replace("{node}", node)


def _socket_directory(path: str) -> None:
    """The socket's directory: made 0755 when missing; refused unless a directory (not
    a link) of this user that nobody else may write."""
    directory = os.path.dirname(path)
    os.makedirs(directory, 0o755, exist_ok=True)
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise UnsafePath(f"cluster.grant_socket: {directory} must be a directory of uid "
                         f"{os.geteuid()} that others cannot write (not a link)")
    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)                  # a previous run's
        else:
            raise UnsafePath(f"cluster.grant_socket: {path} exists and is not a socket")
    except FileNotFoundError:
        pass


async def _send(sock: trio.socket.SocketType, reply: dict[str, Any], fds: list[int]) -> None:
    data = json.dumps(reply, separators=(",", ":")).encode()
    if fds:
        await sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        await sock.send(data)


class GrantServer:
    """Serves the grant socket of one node (module docstring): :meth:`serve` in the
    node's nursery. Runs in the trio thread, as the arena does.

    Attributes:
        arena: the slots and their segments' owners (``segments``, ``locate``, ``pin``).
        memory: the segments' fds (``readonly``).
        readers: ``cluster.host_readers``.
        on_grant: called before segments are handed out (``ArenaFiles.mark_granted``).
        connections: how many are open now.
    """

    def __init__(self, arena: Arena, memory: SegmentMemory, readers: Mapping[str, list[str]],
                 on_grant: Callable[[], None] | None = None) -> None:
        self.arena = arena
        self.memory = memory
        self.readers = readers
        self.on_grant = on_grant                 # before an fd is first sent (ArenaFiles)
        self.connections = 0

    async def serve(self, path: str, *,
                    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen at ``path`` until cancelled (the socket file is removed then)."""
        _socket_directory(path)
        listener = trio.socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with listener:
            await listener.bind(path)
            try:
                os.chmod(path, 0o666)            # who may read what: SO_PEERCRED, per request
                listener.listen(16)
                log.info("grant socket %s: datasets %s", path, ", ".join(self.readers) or "none")
                task_status.started(path)
                async with trio.open_nursery() as nursery:
                    while True:
                        sock, _ = await listener.accept()
                        if self.connections >= MAX_CONNECTIONS:
                            log.warning("grant socket: %d connections open, refusing one",
                                        self.connections)
                            sock.close()
                            continue
                        self.connections += 1
                        nursery.start_soon(self._connection, sock)
            finally:
                with trio.CancelScope(shield=True):
                    try:
                        os.unlink(path)
                    except FileNotFoundError:
                        pass

    async def _connection(self, sock: trio.socket.SocketType) -> None:
        try:
            with sock:
                conn = Connection(peer_of(sock))
                while True:
                    with trio.move_on_after(IDLE):
                        raw = await sock.recv(MAX_MESSAGE + 1)
                        if not raw:
                            return
                        await self._reply(sock, conn, raw)
                        continue
                    return                           # idle
        except OSError as e:                         # the peer went away mid-reply
            log.debug("grant socket: connection ended: %s", e)
        finally:
            self.connections -= 1

    async def _reply(self, sock: trio.socket.SocketType, conn: Connection, raw: bytes) -> None:
        reply, segs = answer(self.arena, self.readers, conn, raw)
        fds: list[int] = []
        try:
            try:
                for s in segs:
                    fds.append(self.memory.readonly(s))
            except OSError as e:                 # out of fds: a refusal, the grant unsent
                reply, segs = error_reply(_refuse(e.errno or errno.EIO, str(e))), []
            for s in segs:
                self.arena.pin(s)
            if segs and self.on_grant is not None:
                self.on_grant()
            await _send(sock, reply, fds)
            conn.sent.update(segs)
        finally:
            for fd in fds:
                os.close(fd)
        if reply["ok"] is False:
            log.info("grant socket: pid %d uid %d: %s", conn.peer.pid, conn.peer.uid,
                     reply["message"])
