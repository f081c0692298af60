"""The reader's side of the grant socket: chunks copied out of the node's memory on this host.

A library process on a node's host asks that node for a grant of its dataset
(``grant.py``: the protocol, the node's side) and from then on copies the chunks the
node holds straight out of read-only mappings of the granted segments, instead of
READing them over loopback vRDMA (``docs/design.md``, "Zero-copy on the node's host")::

    HostGrant.run()                             discovery, at open and on membership changes
      find_grant(template, tag, nodes, dataset) while there is no grant: the live nodes whose
                                                socket exists here (this host's first)
      HostGrant.read → GrantedArena.read(k, key, length, part)
                                                TierChain.from_peers' first step:
        slot hint for key?                      else one ``locate`` of key and the next
                                                chunks' keys (LOCATE_BATCH), answers kept
        copy slot (or the part) out of its      a copy, never a view: the node reuses slots
          segment's mapping
        xxh3 == key (or the part's digest)?     → the bytes; else locate the key again
                                                once, then None (the next step: peers)

Never the reader's error: a refusal, a protocol error or a lost socket is logged once
and the grant is dropped (its mappings closed); every read then goes on as without one,
until the next change of the membership finds a grant again.

The socket and ``read`` belong to the trio thread (a copy runs in the task that wants
it: a 4 MiB copy and its hash take about 0.3 ms, as a peer READ's hash does);
``copy_nowait`` copies a slot already located from any thread (the library answers a
small file's read with it in the calling thread, ``client/reads.py``).
"""
from __future__ import annotations

import array
import errno
import json
import logging
import mmap
import os
import socket
import stat
from collections.abc import Callable, Sequence

import trio

from .. import checksum
from ..cache.memory import page_aligned
from ..errors import GrantLost, GrantRefused
from ..manifest.index import ManifestIndex
from ..tuning import POPULATE_MIN
from . import grant
from .membership import Membership

log = logging.getLogger(__name__)

LOCATE_BATCH = grant.MAX_KEYS          # keys a locate asks: the one wanted, then the next chunks'
LOCATE_SCAN = 4 * LOCATE_BATCH         # chunks looked at for them (bounded: most may be known)
ABSENT_AGAIN = 5.0                     # s: a key the node did not hold is asked about again after
ABSENT_KEPT = 1 << 16                  # null answers kept at most (then forgotten at once)
# s a request may wait for its reply: the node answers from memory in well under a
# millisecond, so a node that takes this long is stopped or swamped, and reads go to the
# peers (whose READs hedge) rather than wait on it
ASK_TIMEOUT = 2.0
_ANCILLARY = socket.CMSG_SPACE(253 * 4)  # SCM_MAX_FD fds

#: (offset, length, digest) of a small file's extent or a block inside its chunk
Part = tuple[int, int, bytes]


class GrantedArena:
    """The segments of one dataset granted by the node on this host, mapped read-only.

    Contract: ``read`` returns bytes copied out of a mapped slot and verified against
    the chunk's key (or a part's digest), or None: the node does not hold it, the copy
    did not verify twice (a slot being reused), or the grant is gone. It never raises
    for the node's behaviour and never returns a view of a mapping. Slot answers are
    kept per key (a null one for ``ABSENT_AGAIN`` s); concurrent reads share one
    ``locate``. ``close`` unmaps everything and closes the socket; ``alive`` (the node
    is still a member) is checked before each read. Trio thread only, but for
    ``copy_nowait`` (any thread: a located slot, copied and verified, or None).

    Attributes:
        node: the granting node's name.
        path: its grant socket.
        dataset: the granted dataset.
        slot_size, per_segment: the arena's geometry (slots of a segment).
        stale: copies that failed verification (a slot reused since it was located).
    """

    def __init__(self, sock: trio.socket.SocketType, node: str, path: str, dataset: str,
                 index: ManifestIndex, alive: Callable[[], bool]) -> None:
        self._sock = sock
        self.node, self.path, self.dataset = node, path, dataset
        self._index = index
        self._alive = alive
        self.slot_size = self.per_segment = 0
        self._maps: dict[int, mmap.mmap] = {}
        self._slots: dict[bytes, tuple[int, int]] = {}
        self._absent: dict[bytes, float] = {}
        self._asking: dict[bytes, trio.Event] = {}
        self._lock = trio.Lock()
        self.stale = 0
        self.closed = False

    # -- the protocol ------------------------------------------------------------------------

    async def ask_grant(self) -> None:
        """The grant request; GrantRefused for a refusal, GrantLost for anything wrong."""
        reply = await self._ask({"v": grant.VERSION, "op": "grant", "dataset": self.dataset})
        slot_size, segment_bytes = reply.get("slot_size"), reply.get("segment_bytes")
        if (not isinstance(slot_size, int) or not isinstance(segment_bytes, int)
                or slot_size <= 0 or segment_bytes < slot_size or segment_bytes % slot_size):
            raise GrantLost(f"grant reply with slot_size {slot_size!r}, "
                            f"segment_bytes {segment_bytes!r}")
        self.slot_size, self.per_segment = slot_size, segment_bytes // slot_size

    async def _ask(self, request: dict[str, object]) -> dict[str, object]:
        """One request and its reply; the fds that came with it mapped."""
        async with self._lock:
            try:
                with trio.fail_after(ASK_TIMEOUT):
                    await self._sock.send(json.dumps(request, separators=(",", ":")).encode())
                    raw, ancillary, flags, _ = await self._sock.recvmsg(grant.MAX_MESSAGE,
                                                                        _ANCILLARY)
            except OSError as e:
                raise GrantLost(f"grant socket: {e}") from e
            except trio.TooSlowError:
                raise GrantLost(f"no reply within {ASK_TIMEOUT:g} s") from None
            fds = _fds(ancillary)
            try:
                if not raw or flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                    raise GrantLost("grant socket closed, or a reply cut short")
                reply = _reply(raw)
                self._map(reply.get("segments", []), fds)
            finally:
                for fd in fds:
                    os.close(fd)
        return reply

    def _map(self, segments: object, fds: list[int]) -> None:
        if not isinstance(segments, list) or len(segments) != len(fds):
            raise GrantLost(f"{len(fds)} fds came for segments {str(segments)[:80]}")
        for seg, fd in zip(segments, fds, strict=True):
            if not isinstance(seg, int) or seg < 0:
                raise GrantLost(f"segment {seg!r} is not a segment number")
            try:
                m = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            except (OSError, ValueError) as e:
                raise GrantLost(f"segment {seg} cannot be mapped: {e}") from e
            old = self._maps.pop(seg, None)
            if old is not None:
                old.close()
            self._maps[seg] = m

    # -- reads -------------------------------------------------------------------------------

    async def read(self, k: int, key: bytes, length: int,
                   part: Part | None = None) -> bytes | memoryview | None:
        """Chunk ``k`` (digest ``key``, ``length`` bytes), or ``part`` of it, verified; or
        None (class docstring)."""
        if self.closed:
            return None
        if not self._alive():
            self.drop("the node left the cluster")
            return None
        try:
            for again in (False, True):
                slot = await self._slot(k, key, again)
                if slot is None:
                    return None
                data = self._copy(slot, length, part if part is not None else (0, length, key))
                if data is not None:
                    return data
                self.stale += 1                  # the slot was reused: ask where it is now
                self._slots.pop(key, None)
            return None
        except (GrantLost, GrantRefused) as e:
            self.drop(str(e))
            return None

    def copy_nowait(self, key: bytes, length: int, part: Part) -> bytes | memoryview | None:
        """``part`` of the chunk with digest ``key`` (``length`` bytes) copied out of its
        slot and verified, from any thread, when its slot is known: no locate, no retry
        (None: ask ``read`` in the trio thread). Safe against ``close`` in the trio
        thread: a slice of an mmap is copied under the GIL, and a closed one raises
        ValueError, which is a miss here."""
        slot = self._slots.get(key)
        if slot is None or self.closed:
            return None
        try:
            return self._copy(slot, length, part)
        except ValueError:                       # unmapped meanwhile (the grant dropped)
            return None

    async def _slot(self, k: int, key: bytes, again: bool) -> tuple[int, int] | None:
        """Where ``key`` sits: the kept answer, else a locate (``again``: of it alone)."""
        if not again:
            if key in self._slots:
                return self._slots[key]
            if self._absent.get(key, -ABSENT_AGAIN) + ABSENT_AGAIN > trio.current_time():
                return None
        asking = self._asking.get(key)
        if asking is not None:
            await asking.wait()
        else:
            await self._locate([key] if again else self._batch(k, key))
        return self._slots.get(key)

    def _batch(self, k: int, key: bytes) -> list[bytes]:
        """``key`` and the next chunks' keys with no answer yet: a reader of chunk k reads
        k+1 next, or soon (an epoch reads them all)."""
        ix, now = self._index, trio.current_time()
        keys = [key]
        for j in range(k + 1, min(ix.chunks, k + 1 + LOCATE_SCAN)):
            if len(keys) == LOCATE_BATCH:
                break
            other = ix.chunk_digest(j)
            if (other not in self._slots and other not in self._asking
                    and self._absent.get(other, -ABSENT_AGAIN) + ABSENT_AGAIN <= now):
                keys.append(other)
        return list(dict.fromkeys(keys))

    async def _locate(self, keys: list[bytes]) -> None:
        done = trio.Event()
        for key in keys:
            self._asking[key] = done
        try:
            reply = await self._ask({"v": grant.VERSION, "op": "locate",
                                     "keys": [key.hex() for key in keys]})
            slots = reply.get("slots")
            if not isinstance(slots, list) or len(slots) != len(keys):
                raise GrantLost("a locate reply without one answer per key")
            now = trio.current_time()
            for key, hit in zip(keys, slots, strict=True):
                if (isinstance(hit, list) and len(hit) == 2
                        and all(isinstance(x, int) and x >= 0 for x in hit)):
                    self._slots[key] = (hit[0], hit[1])
                    self._absent.pop(key, None)
                else:
                    self._slots.pop(key, None)
                    self._absent[key] = now
            if len(self._absent) > ABSENT_KEPT:  # bounded: asking again is only a locate
                self._absent.clear()
        finally:
            for key in keys:
                del self._asking[key]
            done.set()

    def _copy(self, slot: tuple[int, int], length: int, part: Part) -> bytes | memoryview | None:
        """The part's bytes copied out of ``slot`` and verified, or None."""
        s, held = slot
        offset, want, digest = part
        m = self._maps.get(s // self.per_segment)
        if held != length or m is None or offset + want > length:
            return None
        at = (s % self.per_segment) * self.slot_size + offset
        if at + want > len(m):
            return None
        # a copy, never a view: the node may reuse the slot; a chunk into a buffer faulted
        # in without the GIL, or a spare (cache/memory.py), a small part as bytes
        data: bytes | memoryview
        if want >= POPULATE_MIN:
            buf = page_aligned(want)
            buf[:] = memoryview(m)[at:at + want]
            data = buf.toreadonly()
        else:
            data = m[at:at + want]
        return data if checksum.matches(data, digest) else None

    @property
    def segments(self) -> int:
        """How many segments are mapped."""
        return len(self._maps)

    # -- the end -----------------------------------------------------------------------------

    def drop(self, why: str) -> None:
        """Give the grant up (logged once): reads go to the peers from now on."""
        if not self.closed:
            log.warning("host grant of %s from %s dropped (%s): reading over vRDMA again",
                        self.dataset, self.node, why)
            self.close()

    def close(self) -> None:
        """Unmap the segments and close the socket; idempotent."""
        self.closed = True
        for m in self._maps.values():
            m.close()
        self._maps.clear()
        self._slots.clear()
        self._sock.close()


def _fds(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    fds = array.array("i")
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    return list(fds)


def _reply(raw: bytes) -> dict[str, object]:
    """A reply datagram: an ``ok`` object, GrantRefused for an error reply, else GrantLost."""
    try:
        reply = json.loads(raw)
    except ValueError as e:
        raise GrantLost("a reply that is not JSON") from e
    if not isinstance(reply, dict):
        raise GrantLost("a reply that is not a JSON object")
    if reply.get("ok") is not True:
        code = getattr(errno, str(reply.get("errno")), None)
        if not isinstance(code, int) or code <= 0:   # a name, but not an errno's (__doc__)
            code = errno.EIO
        message = " ".join(str(reply.get("message", "refused")).split())  # one log line
        raise GrantRefused(message[:200] or "refused", errno=code)
    return reply


class HostGrant:
    """The grant of one dataset by the node on this host, looked for again when there
    is none: the ``HostReader`` the library's tier chain asks (``cache/tiers.py``).

    Contract: ``read`` and ``copy_nowait`` are the current grant's (``GrantedArena``),
    None while there is none. ``run`` (in a nursery) looks for one at once, then again
    on each change of the membership while it has none, or once its node has left (so
    a node that starts on this host after the dataset was opened, or comes back, is
    found; a refusal is asked again only then). ``order()``: the members to try, this
    host's first. ``close`` closes the current grant. Trio thread only, but for
    ``copy_nowait``.

    Attributes:
        current: the grant in use, or None.
    """

    def __init__(self, template: str, tag: str, dataset: str, index: ManifestIndex,
                 membership: Membership, order: Callable[[], list[str]]) -> None:
        self.template, self.tag, self.dataset = template, tag, dataset
        self._index = index
        self.membership = membership
        self._order = order
        self.current: GrantedArena | None = None
        self._tried = False

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Look for a grant now (then ``task_status.started``), and on every change."""
        changed = self.membership.changed
        await self._find()
        task_status.started()
        while True:
            await changed.wait()
            changed = self.membership.changed       # before looking: a change meanwhile counts
            await self._find()

    async def _find(self) -> None:
        current = self.current
        if current is not None and not current.closed and current.node not in self.membership.nodes:
            current.drop("the node left the cluster")
        if current is None or current.closed:
            self.current = await find_grant(self.template, self.tag, self._order(), self.dataset,
                                            self._index, lambda n: n in self.membership.nodes,
                                            quiet=self._tried)
            self._tried = True

    async def read(self, k: int, key: bytes, length: int,
                   part: Part | None = None) -> bytes | memoryview | None:
        current = self.current
        return None if current is None else await current.read(k, key, length, part)

    def copy_nowait(self, key: bytes, length: int, part: Part) -> bytes | memoryview | None:
        current = self.current
        return None if current is None else current.copy_nowait(key, length, part)

    def close(self) -> None:
        if self.current is not None:
            self.current.close()


async def find_grant(template: str, tag: str, nodes: Sequence[str], dataset: str,
                     index: ManifestIndex, alive: Callable[[str], bool],
                     quiet: bool = False) -> GrantedArena | None:
    """A grant of ``dataset`` from the first of ``nodes`` (this host's node first: the
    caller's order) whose grant socket exists here and grants it; None when none does
    (logged at info, at debug when ``quiet``). ``alive(node)``: whether the node is
    still a member."""
    reasons = []
    for node in nodes:
        path = grant.socket_path(template, tag, node)
        if not os.path.exists(path):
            continue
        try:
            granted = await _connect(path, node, dataset, index, alive)
        except (OSError, GrantLost, GrantRefused) as e:
            reasons.append(f"{node}: {e}")
            continue
        log.info("host grant: %s from node %s (%s): %d segments mapped", dataset, node, path,
                 granted.segments)
        return granted
    level = logging.DEBUG if quiet else logging.INFO
    if reasons:
        log.log(level, "host grant of %s: none (%s); reading over vRDMA", dataset,
                "; ".join(reasons))
    else:
        log.log(level, "host grant of %s: no grant socket of a node here; reading over vRDMA",
                dataset)
    return None


def untrusted(path: str, server_uid: int) -> str | None:
    """Why the grant socket at ``path``, served by ``server_uid``, may be someone's
    decoy, or None. Bytes from a grant are checked against xxh3, which is no defence
    against a crafted collision, so the server must be the node: its directory is not
    writable by others, the server is root or the directory's owner, and a directory
    not owned by root sits in one only privileged users could make it in (in ``/tmp``
    anyone could make a directory of their own and serve a socket in it)."""
    directory = os.path.dirname(path)
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode) or st.st_mode & 0o022:
        return f"{directory} is not a directory others cannot write"
    if server_uid not in (0, st.st_uid):
        return f"served by uid {server_uid}, not by {directory}'s owner"
    if st.st_uid != 0 and os.stat(os.path.dirname(directory) or "/").st_mode & 0o022:
        return f"{directory} is not root's and others may write its parent"
    return None


async def _connect(path: str, node: str, dataset: str, index: ManifestIndex,
                   alive: Callable[[str], bool]) -> GrantedArena:
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    granted = GrantedArena(sock, node, path, dataset, index, lambda: alive(node))
    try:
        await sock.connect(path)
        why = untrusted(path, grant.peer_of(sock).uid)
        if why is not None:
            raise GrantLost(f"refusing {path}: {why}")
        await granted.ask_grant()
    except BaseException:
        granted.close()
        raise
    return granted
