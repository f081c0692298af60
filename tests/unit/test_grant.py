"""The grant socket (``cluster/grant.py``): a real socket, a real arena in memfd segments,
clients in subprocesses running as ``nobody`` (uid 65534) as a local user would.

Root is granted any dataset; nobody is refused one it has no grant for and granted one
listed for it; the fds it gets are read-only (no writable shared mapping, no writable
reopen through /proc); ``locate`` answers only the granted dataset's keys; the bytes at
the located slot of the mapped segment are the chunk. The parser is fuzzed (Hypothesis,
a bounded budget): every datagram gets a reply or a refusal, never an exception."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kspeedfs.cluster import grant
from kspeedfs.cluster.arena import Arena, Geometry
from kspeedfs.cluster.arena_segments import SegmentMemory
from kspeedfs.cluster.grant import Connection, GrantServer, Peer, allows, answer, parse_request
from tests.fixtures import grant_client

from .test_arena import Mem

NOBODY = 65534
SLOT = 64 << 10
FUZZ = settings(max_examples=300, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (clients run as nobody)")


class MapBuffer(Mem):
    """The segments' mapping with the vMR read/write interface."""

    def __init__(self, memory: Any) -> None:
        self.length = len(memory)
        self.b = memory


def _blob(i: int) -> tuple[bytes, bytes]:
    blob = bytes([i]) * (1000 + i)
    return xxhash.xxh3_128_digest(blob), blob


@pytest.fixture
def arena() -> Iterator[tuple[Arena, SegmentMemory, dict[str, bytes]]]:
    """14 slots in segments of 4 (the last of 2): keys 0-4 of "imgs" (segments 0, 1),
    5-7 of "text" (2), 8 of no group (3)."""
    g = Geometry.for_memory(14 * SLOT, SLOT, segment_bytes=4 * SLOT)
    memory = SegmentMemory.anonymous(g, "test")
    groups: dict[bytes, str | None] = {}
    a = Arena(g, MapBuffer(memory.memory), Mem(g.index_bytes), group=lambda k: groups.get(k))
    keys = {}
    for i in range(9):
        key, blob = _blob(i)
        groups[key] = "imgs" if i < 5 else "text" if i < 8 else None
        assert a.put(key, blob)
        keys[f"{i}"] = key
    try:
        yield a, memory, keys
    finally:
        memory.close()
        memory.memory.close()


@pytest.fixture
def socket_dir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="kspeedfs-grant-")
    os.chmod(d, 0o755)                  # nobody must reach the socket
    try:
        yield d
    finally:
        subprocess.run(["rm", "-rf", d], check=False)


@asynccontextmanager
async def _server(arena: Arena, memory: SegmentMemory, readers: dict[str, list[str]],
                  directory: str) -> AsyncIterator[str]:
    server = GrantServer(arena, memory, readers)
    async with trio.open_nursery() as n:
        path = await n.start(server.serve, os.path.join(directory, "run", "c-n1.grant"))
        yield path
        n.cancel_scope.cancel()


CLIENT = r'''
import json, mmap, os, socket, sys
from tests.fixtures.grant_client import ask
path, requests = sys.argv[1], json.loads(sys.argv[2])
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect(path)
out, maps = [], {}
for req in requests:
    reply, fds = ask(s, req)
    checks = {}
    for seg, fd in zip(reply.get("segments", []), fds):
        size = os.fstat(fd).st_size
        try:
            mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            checks["writable_map"] = True
        except PermissionError:
            pass
        try:
            os.close(os.open(f"/proc/self/fd/{fd}", os.O_RDWR))
            checks["writable_reopen"] = True
        except PermissionError:
            pass
        maps[seg] = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        os.close(fd)
    if reply.get("ok") and "slots" in reply:
        per = reply_grant["segment_bytes"] // reply_grant["slot_size"]
        reply["bytes"] = [maps[sl // per][(sl % per) * reply_grant["slot_size"]:][:n].hex()
                          if [sl, n] != [None, None] else None
                          for sl, n in (x or [None, None] for x in reply["slots"])]
    if reply.get("ok") and "slot_size" in reply:
        reply_grant = reply
    out.append({"reply": reply, "fds": len(fds), **checks})
print(json.dumps(out))
'''


async def _client(path: str, requests: list[dict[str, Any]], uid: int = NOBODY,
                  groups: list[int] | None = None) -> list[dict[str, Any]]:
    def run() -> str:
        return subprocess.run([sys.executable, "-c", CLIENT, path, json.dumps(requests)],
                              user=uid, group=uid, extra_groups=groups or [], cwd="/",
                              env=grant_client.script_env(),
                              capture_output=True, text=True, check=True, timeout=30).stdout
    result: list[dict[str, Any]] = json.loads(await trio.to_thread.run_sync(run))
    return result


def _locate(*keys: bytes) -> dict[str, Any]:
    return {"v": 1, "op": "locate", "keys": [k.hex() for k in keys]}


GRANT_IMGS = {"v": 1, "op": "grant", "dataset": "imgs"}


async def test_root_is_granted_and_reads_the_chunk_from_the_mapping(arena, socket_dir) -> None:
    a, memory, keys = arena
    async with _server(a, memory, {"imgs": []}, socket_dir) as path:
        out = await _client(path, [GRANT_IMGS, _locate(keys["0"], keys["5"], keys["8"])], uid=0)
    granted, located = out[0]["reply"], out[1]["reply"]
    assert granted["ok"] and granted["slot_size"] == SLOT and granted["segment_bytes"] == 4 * SLOT
    assert granted["segments"] == a.segments("imgs") == [0, 1] and out[0]["fds"] == 2
    assert located["ok"] and located["slots"][1:] == [None, None] and located["segments"] == []
    assert bytes.fromhex(located["bytes"][0]) == _blob(0)[1]


async def test_nobody_is_refused_without_a_grant_and_granted_with_one(arena, socket_dir) -> None:
    a, memory, keys = arena
    async with _server(a, memory, {"imgs": [], "text": [f"uid:{NOBODY}"]}, socket_dir) as path:
        refused = await _client(path, [GRANT_IMGS, _locate(keys["0"])])
        granted = await _client(path, [{"v": 1, "op": "grant", "dataset": "text"},
                                       _locate(keys["0"], keys["5"], keys["7"]), GRANT_IMGS])
        by_group = await _client(path, [GRANT_IMGS], groups=[4242])
    async with _server(a, memory, {"imgs": ["gid:4242"]}, socket_dir) as path:
        by_group_granted = await _client(path, [GRANT_IMGS], groups=[4242])
    assert refused[0]["reply"]["errno"] == "EACCES" and refused[0]["fds"] == 0
    assert refused[1]["reply"]["errno"] == "ENOENT"                      # locate before grant
    text = granted[0]["reply"]
    assert text["ok"] and text["segments"] == a.segments("text") and granted[0]["fds"] == 1
    assert "writable_map" not in granted[0] and "writable_reopen" not in granted[0]
    located = granted[1]["reply"]
    assert located["slots"][0] is None                                  # imgs' key: not told
    assert [bytes.fromhex(b) for b in located["bytes"][1:]] == [_blob(5)[1], _blob(7)[1]]
    assert granted[2]["reply"]["errno"] == "EALREADY"                   # one grant a connection
    assert by_group[0]["reply"]["errno"] == "EACCES"
    assert by_group_granted[0]["reply"]["ok"] and by_group_granted[0]["fds"] == 2


async def _exchange(s: trio.socket.SocketType, req: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """One request on an open connection: the reply and how many fds came with it."""
    await s.send(json.dumps(req).encode())
    data, anc, _, _ = await s.recvmsg(grant.MAX_MESSAGE, socket.CMSG_SPACE(253 * 4))
    fds = [int.from_bytes(p[i:i + 4], "little") for _, _, p in anc for i in range(0, len(p), 4)]
    for fd in fds:
        os.close(fd)
    return json.loads(data), len(fds)


async def test_a_segment_filled_after_the_grant_comes_with_locate(arena, socket_dir) -> None:
    """A grant's segments grow as its dataset does: ``locate`` sends the new ones, and
    the segments handed out stay the dataset's when emptied (pinned)."""
    a, memory, keys = arena
    groups = a.group
    a.group = lambda k: groups(k) if k in keys.values() else "imgs"
    for i in (20, 21, 22):                                  # segment 1 full of imgs
        assert a.put(*_blob(i))
    async with _server(a, memory, {"imgs": ["*"]}, socket_dir) as path:
        s = trio.socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        await s.connect(path)
        reply, fds = await _exchange(s, GRANT_IMGS)
        assert reply["segments"] == [0, 1] and fds == 2
        for i in (5, 6, 7):
            a.drop(keys[str(i)])                            # "text" leaves segment 2
        key, blob = _blob(23)
        assert a.put(key, blob) and a.segments("imgs") == [0, 1, 2]
        reply, fds = await _exchange(s, _locate(key, keys["0"]))
        assert reply["segments"] == [2] and fds == 1 and reply["slots"][0][0] // 4 == 2
        reply, fds = await _exchange(s, _locate(key))
        assert reply["segments"] == [] and fds == 0
        s.close()
    a.drop(key)
    assert a.segments("imgs") == [0, 1, 2]                  # pinned: never text's again


async def test_hostile_datagrams_get_refusals_and_the_server_goes_on(arena, socket_dir) -> None:
    a, memory, keys = arena
    async with _server(a, memory, {"imgs": ["*"]}, socket_dir) as path:
        s = trio.socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        await s.connect(path)
        for bad in (b"{", b"[]", b'{"v":2,"op":"grant"}', b'{"v":1,"op":"rm"}',
                    b"[" * 100000, json.dumps(_locate(*[keys["0"]] * 1025)).encode(),
                    b"x" * (grant.MAX_MESSAGE + 10)):
            await s.send(bad)
            reply = json.loads(await s.recv(grant.MAX_MESSAGE))
            assert reply["ok"] is False and reply["errno"] in ("EINVAL", "EMSGSIZE")
        s.close()
        out = await _client(path, [GRANT_IMGS])
    assert out[0]["reply"]["ok"]


def test_allows() -> None:
    resolve = {"user:alice": 1000, "group:ml": 300}.get
    alice = Peer(1, 1000, 1000, frozenset({300}))
    assert allows([], Peer(1, 0, 0), resolve)
    assert not allows([], alice, resolve)
    assert allows(["user:alice"], alice, resolve) and allows(["group:ml"], alice, resolve)
    assert allows(["gid:1000"], alice, resolve) and allows(["*"], alice, resolve)
    assert not allows(["uid:1001", "gid:7", "user:bob", "group:nope"], alice, resolve)


keys_st = st.one_of(st.text(max_size=40), st.binary(min_size=16, max_size=16).map(bytes.hex),
                    st.integers(), st.none())
requests = st.one_of(
    st.binary(max_size=300),
    st.fixed_dictionaries({"v": st.sampled_from([1, 2, True, "1"]),
                           "op": st.sampled_from(["grant", "locate", "x", 1])},
                          optional={"dataset": st.one_of(st.text(max_size=300), st.integers()),
                                    "keys": st.one_of(st.lists(keys_st, max_size=30),
                                                      st.text(max_size=5))}).map(
        lambda d: json.dumps(d).encode()),
    st.recursive(st.none() | st.integers() | st.text(max_size=5),
                 lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=3), c,
                                                                     max_size=3)).map(
        lambda v: json.dumps(v).encode()))


@FUZZ
@given(datagrams=st.lists(requests, min_size=1, max_size=5), uid=st.sampled_from([0, NOBODY]))
def test_fuzz_every_datagram_gets_one_reply(arena, datagrams: list[bytes], uid: int) -> None:
    a, _, keys = arena
    conn = Connection(Peer(1, uid, uid))
    for raw in datagrams:
        reply, segs = answer(a, {"imgs": ["uid:5"]}, conn, raw)
        assert isinstance(reply["ok"], bool) and len(json.dumps(reply)) <= grant.MAX_MESSAGE
        if not reply["ok"]:
            assert reply["errno"] in ("EINVAL", "EACCES", "EALREADY", "ENOENT", "EMSGSIZE")
            assert segs == [] and "\n" not in reply["message"]
        else:
            assert conn.dataset is not None and set(segs) <= set(a.segments(conn.dataset))
            conn.sent.update(segs)
        if conn.dataset not in (None, "imgs"):
            assert segs == []                        # a dataset with no entry: no segment


@FUZZ
@given(raw=st.binary(max_size=200))
def test_fuzz_parse_request_raises_only_refusals(raw: bytes) -> None:
    try:
        parse_request(raw)
    except grant.GrantRefused:
        pass


def test_a_full_locate_reply_fits_a_datagram(arena) -> None:
    a, _, keys = arena
    conn = Connection(Peer(1, 0, 0))
    answer(a, {"imgs": []}, conn, json.dumps(GRANT_IMGS).encode())
    reply, _ = answer(a, {}, conn, json.dumps(_locate(*[keys["0"]] * 1024)).encode())
    assert reply["ok"] and len(json.dumps(reply, separators=(",", ":"))) < grant.MAX_MESSAGE
