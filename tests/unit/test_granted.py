"""The reader's side of the grant socket (``cluster/granted.py``) against a real grant
server over a real arena in memfd segments (``test_grant.py``'s fixtures): chunks and
parts copied out of the mapped segments and verified; a slot rewritten under a kept
answer is a miss, never wrong bytes; a node that goes away drops the grant, and reads
return None (the next step) instead of raising."""
from __future__ import annotations

import os
import socket
from typing import Any

import trio
import trio.testing
import xxhash

from kspeedfs.cluster import granted as granted_mod
from kspeedfs.cluster.granted import GrantedArena, HostGrant, find_grant, untrusted

from .test_grant import NOBODY, SLOT, _blob, _server, arena, pytestmark, socket_dir  # noqa: F401


class Keys:
    """The manifest's chunk keys, as ``GrantedArena`` asks them (``ManifestIndex``'s
    ``chunks`` and ``chunk_digest``)."""

    def __init__(self, keys: list[bytes]) -> None:
        self.keys = keys
        self.chunks = len(keys)

    def chunk_digest(self, k: int) -> bytes:
        return self.keys[k]


def _ordered(keys: dict[str, bytes]) -> list[bytes]:
    return [keys[str(i)] for i in range(9)]


async def _granted(path: str, keys: list[bytes], dataset: str = "imgs") -> GrantedArena:
    found = await find_grant(os.path.join(os.path.dirname(path), "c-{node}.grant"), "c",
                             ["n0", "n1"], dataset, Keys(keys), lambda n: True)  # type: ignore[arg-type]
    assert found is not None and found.node == "n1"      # n0 has no socket here
    return found


async def test_chunks_and_parts_come_verified_from_the_mapping(arena, socket_dir) -> None:  # noqa: F811
    a, memory, keys = arena
    ordered = _ordered(keys)
    async with _server(a, memory, {"imgs": ["*"], "text": ["*"]}, socket_dir) as path:
        g = await _granted(path, ordered)
        try:
            for i, key in enumerate(ordered):
                blob = _blob(i)[1]
                data = await g.read(i, key, len(blob))
                assert data == (blob if i < 5 else None)     # only imgs is granted here
            part = (100, 200, xxhash.xxh3_64_digest(_blob(3)[1][100:300]))
            assert await g.read(3, ordered[3], len(_blob(3)[1]), part) == _blob(3)[1][100:300]
            bad_part = (100, 200, bytes(8))
            assert await g.read(3, ordered[3], len(_blob(3)[1]), bad_part) is None
            assert await g.read(0, ordered[0], 12345) is None   # not the manifest's length
            assert g.segments == 2 and not g.closed
        finally:
            g.close()


async def test_a_locate_answers_the_next_chunks_too(arena, socket_dir, monkeypatch) -> None:  # noqa: F811
    a, memory, keys = arena
    ordered = _ordered(keys)
    asked: list[int] = []
    locate = GrantedArena._locate

    async def counting(self: GrantedArena, batch: list[bytes]) -> None:
        asked.append(len(batch))
        await locate(self, batch)

    monkeypatch.setattr(GrantedArena, "_locate", counting)
    async with _server(a, memory, {"imgs": ["*"]}, socket_dir) as path:
        g = await _granted(path, ordered)
        async with trio.open_nursery() as n:             # concurrent reads share a locate
            for i in range(5):
                n.start_soon(g.read, i, ordered[i], len(_blob(i)[1]))
        assert sum(asked) == 9 and len(asked) <= 5        # each key asked about once
        n_asked = len(asked)
        for i in range(5):
            assert await g.read(i, ordered[i], len(_blob(i)[1])) == _blob(i)[1]
        assert len(asked) == n_asked                      # kept answers, no more locates
        g.close()


async def test_a_rewritten_slot_is_a_miss_then_found_again(arena, socket_dir) -> None:  # noqa: F811
    a, memory, keys = arena
    ordered = _ordered(keys)
    blob = _blob(2)[1]
    async with _server(a, memory, {"imgs": ["*"]}, socket_dir) as path:
        g = await _granted(path, ordered)
        assert await g.read(2, ordered[2], len(blob)) == blob
        slot = a.locate(ordered[2], "imgs")
        assert slot is not None
        at = slot[0] * SLOT
        memory.memory[at:at + 10] = b"x" * 10           # the node reuses the slot mid-read
        assert await g.read(2, ordered[2], len(blob)) is None
        assert g.stale == 2 and not g.closed            # copied twice, located again once
        memory.memory[at:at + 10] = blob[:10]
        assert await g.read(2, ordered[2], len(blob)) == blob
        g.close()


async def test_a_node_gone_drops_the_grant_and_reads_go_on(arena, socket_dir) -> None:  # noqa: F811
    a, memory, keys = arena
    ordered = _ordered(keys)
    async with _server(a, memory, {"imgs": ["*"]}, socket_dir) as path:
        g = await _granted(path, ordered[:1])            # locates key 0 alone
        assert await g.read(0, ordered[0], len(_blob(0)[1])) == _blob(0)[1]
    assert await g.read(0, ordered[0], len(_blob(0)[1])) == _blob(0)[1]   # kept: verified
    g._index = Keys(ordered)                             # (the socket is gone now)
    assert await g.read(1, ordered[1], len(_blob(1)[1])) is None
    assert g.closed and g.segments == 0
    assert await g.read(0, ordered[0], len(_blob(0)[1])) is None


async def test_a_member_no_more_drops_the_grant(arena, socket_dir) -> None:  # noqa: F811
    a, memory, keys = arena
    ordered = _ordered(keys)
    alive = [True]
    async with _server(a, memory, {"imgs": ["*"]}, socket_dir) as path:
        g = await find_grant(os.path.join(os.path.dirname(path), "c-{node}.grant"), "c",
                             ["n1"], "imgs", Keys(ordered), lambda n: alive[0])  # type: ignore[arg-type]
        assert g is not None
        assert await g.read(0, ordered[0], len(_blob(0)[1])) == _blob(0)[1]
        alive[0] = False
        assert await g.read(0, ordered[0], len(_blob(0)[1])) is None and g.closed


async def test_no_socket_or_a_server_that_talks_nonsense_is_no_grant(socket_dir) -> None:  # noqa: F811
    assert await find_grant(os.path.join(socket_dir, "{node}.grant"), "c", ["n1"], "imgs",
                            Keys([]), lambda n: True) is None       # type: ignore[arg-type]

    async def nonsense(conn: trio.socket.SocketType) -> None:
        await conn.recv(65536)
        await conn.send(b'{"ok": true, "slot_size": "big"}')
        await conn.recv(65536)

    assert await _one_server(socket_dir, nonsense) is None


def test_locate_batches_fit_the_servers_limit() -> None:
    assert granted_mod.LOCATE_BATCH <= 1024


async def test_copy_nowait_only_copies_a_located_slot_and_verifies_it(arena, socket_dir) -> None:  # noqa: F811
    a, memory, keys = arena
    ordered = _ordered(keys)
    blob = _blob(1)[1]
    part = (10, 500, xxhash.xxh3_128_digest(blob[10:510]))
    async with _server(a, memory, {"imgs": ["*"]}, socket_dir) as path:
        g = await _granted(path, ordered)
        assert g.copy_nowait(ordered[1], len(blob), part) is None       # not located yet
        assert await g.read(0, ordered[0], len(_blob(0)[1])) == _blob(0)[1]   # locates 0-8
        got = await trio.to_thread.run_sync(g.copy_nowait, ordered[1], len(blob), part)
        assert got == blob[10:510] and isinstance(got, bytes)
        assert g.copy_nowait(ordered[1], len(blob), (10, 500, bytes(16))) is None
        g.close()
        assert g.copy_nowait(ordered[1], len(blob), part) is None


def test_a_socket_someone_else_could_have_planted_is_not_trusted(socket_dir) -> None:  # noqa: F811
    """xxh3 is no defence against a crafted collision: the server must be the node."""
    mine = os.path.join(socket_dir, "run")
    os.mkdir(mine, 0o755)
    path = os.path.join(mine, "c-n1.grant")
    assert untrusted(path, 0) is None                    # root's directory, root serving
    assert untrusted(path, NOBODY) is not None           # served by someone else
    os.chmod(mine, 0o777)
    assert untrusted(path, 0) is not None                # anyone could have put it there
    os.chmod(mine, 0o755)
    os.chown(mine, NOBODY, NOBODY)
    assert untrusted(path, NOBODY) is None               # a node running as its owner ...
    os.chmod(socket_dir, 0o1777)
    assert untrusted(path, NOBODY) is not None           # ... unless anyone could make it


async def test_a_server_in_a_directory_others_may_write_is_no_grant(arena, socket_dir) -> None:  # noqa: F811
    a, memory, keys = arena
    async with _server(a, memory, {"imgs": ["*"]}, socket_dir) as path:
        os.chmod(os.path.dirname(path), 0o777)
        found = await find_grant(os.path.join(os.path.dirname(path), "c-{node}.grant"), "c",
                                 ["n1"], "imgs", Keys(_ordered(keys)), lambda n: True)  # type: ignore[arg-type]
        assert found is None
        os.chmod(os.path.dirname(path), 0o755)


class Members:
    """The membership ``HostGrant`` follows: ``nodes`` and the ``changed`` event."""

    def __init__(self, *nodes: str) -> None:
        self.nodes = dict.fromkeys(nodes)
        self.changed = trio.Event()

    def change(self, *nodes: str) -> None:
        self.nodes = dict.fromkeys(nodes)
        old, self.changed = self.changed, trio.Event()
        old.set()


async def test_a_host_grant_is_found_again_after_a_membership_change(arena, socket_dir) -> None:  # noqa: F811
    """No node at open, then one on this host; it leaves (its grant dropped) and comes
    back: each change of the membership looks again while there is no grant."""
    a, memory, keys = arena
    ordered = _ordered(keys)
    blob = _blob(0)[1]
    members = Members()
    template = os.path.join(socket_dir, "run", "c-{node}.grant")
    host = HostGrant(template, "c", "imgs", Keys(ordered), members,  # type: ignore[arg-type]
                     lambda: sorted(members.nodes))
    async with trio.open_nursery() as n:
        await n.start(host.run)
        assert host.current is None and await host.read(0, ordered[0], len(blob)) is None
        async with _server(a, memory, {"imgs": ["*"]}, socket_dir):
            members.change("n1")                         # the node on this host starts
            await trio.testing.wait_all_tasks_blocked()
            assert await host.read(0, ordered[0], len(blob)) == blob
            first = host.current
            members.change()                             # it leaves: the grant is dropped
            await trio.testing.wait_all_tasks_blocked()
            assert first is not None and first.closed and host.current is None
            members.change("n1")                         # and is back
            await trio.testing.wait_all_tasks_blocked()
            assert host.current is not None and host.current is not first
            assert host.copy_nowait(ordered[0], len(blob), (0, len(blob), ordered[0])) is None
            assert await host.read(0, ordered[0], len(blob)) == blob    # located again
            assert host.copy_nowait(ordered[0], len(blob), (0, len(blob), ordered[0])) == blob
        n.cancel_scope.cancel()
    host.close()


async def test_a_node_that_does_not_answer_is_no_grant_and_stalls_no_read(
        arena, socket_dir, monkeypatch) -> None:  # noqa: F811
    """A stopped node (connected, never replying) costs a request ``ASK_TIMEOUT`` once:
    at the grant, no grant; at a locate, the grant is dropped and the read goes on."""
    monkeypatch.setattr(granted_mod, "ASK_TIMEOUT", 0.2)

    async def silent(conn: trio.socket.SocketType) -> None:
        await trio.sleep_forever()

    with trio.fail_after(5):
        assert await _one_server(socket_dir, silent) is None
    a, memory, keys = arena
    ordered = _ordered(keys)
    async with _server(a, memory, {"imgs": ["*"]}, socket_dir) as served:
        g = await _granted(served, ordered[:1])
        g._sock.send = _never                           # the node stops answering  # type: ignore[method-assign]
        g._index = Keys(ordered)
        with trio.fail_after(5):
            assert await g.read(1, ordered[1], len(_blob(1)[1])) is None
        assert g.closed


async def _never(data: bytes) -> int:
    await trio.sleep_forever()
    return 0


async def _one_server(directory: str, serve: Any) -> GrantedArena | None:
    """``find_grant`` against a server at ``directory``/n1.grant that runs
    ``serve(connection)`` on its one connection (a server that is not the node's)."""
    listener = trio.socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    await listener.bind(os.path.join(directory, "n1.grant"))
    listener.listen(1)

    async def one() -> None:
        conn, _ = await listener.accept()
        with conn:
            await serve(conn)

    with listener:
        async with trio.open_nursery() as n:
            n.start_soon(one)
            found = await find_grant(os.path.join(directory, "{node}.grant"), "c", ["n1"],
                                     "imgs", Keys([]), lambda n: True)  # type: ignore[arg-type]
            n.cancel_scope.cancel()
    return found
