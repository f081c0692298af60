"""A node's copy of manifest pages (kspeedfs/cluster/page_copy.py): the ``page`` RPC over
real authenticated channels on 127.0.0.1, the checks of a peer's reply (fuzzed), the
copy's directory checks, a fill from peers (tables last), the sweep, and a mount's page
directories and wait (manifest/load.py)."""
from __future__ import annotations

import base64
import hashlib
import os
import random
import shutil
import threading
import time
import zlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kspeedfs.cluster import page_copy, rpc
from kspeedfs.cluster.connections import Connections
from kspeedfs.cluster.membership import NodeRecord
from kspeedfs.cluster.node_stats import NodeCounters
from kspeedfs.cluster.page_copy import (
    PageCopy,
    PageRefused,
    page_request,
    parse_page_hash,
    parse_page_reply,
)
from kspeedfs.cluster.placement import Member
from kspeedfs.config import Config
from kspeedfs.errors import ConfigError, KspeedfsError, ManifestCorrupt, UnsafePath
from kspeedfs.manifest import load
from kspeedfs.manifest.load import mount_wait, open_index, page_dirs
from kspeedfs.manifest.pages import Root, page_path, put_page, read_all, read_table, write_pages
from kspeedfs.manifest.store.base import DatasetInfo
from kspeedfs.tuning import PAGE_REPLY_MAX
from tests.fixtures.hostile import LO, json_values

SECRET = b"t3-page-copy-secret"
PS = 4096
FUZZ = settings(max_examples=200, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
PAGE = b"manifest bytes " * 200
DIGEST = hashlib.sha256(PAGE).digest()


def _reply(data: bytes) -> dict[str, Any]:
    return {"page": base64.b64encode(data).decode()}


def _copy(tmp_path: Path, store_pages: str | None = None, **kw: Any) -> PageCopy:
    return PageCopy(str(tmp_path / "copy"), store_pages, "me", kw.get("store"),  # type: ignore[arg-type]
                    kw.get("membership"), kw.get("connections"), NodeCounters(), 4)


def _raw(n: int, seed: int = 1) -> bytes:
    return random.Random(seed).randbytes(n)                    # every page distinct


# -- a peer's reply --------------------------------------------------------------------------


def test_a_reply_holding_the_page_is_taken_and_absent_is_none() -> None:
    data = zlib.compress(PAGE)
    assert parse_page_reply(_reply(data), DIGEST, len(PAGE)) == data
    assert parse_page_reply({"absent": True}, DIGEST, len(PAGE)) is None


@pytest.mark.parametrize("reply, why", [
    (_reply(zlib.compress(PAGE + b"x")), "stream of"),              # another length
    (_reply(zlib.compress(PAGE[:-1] + b"y")), "SHA-256"),            # same length, other bytes
    (_reply(zlib.compress(PAGE) + b"junk"), "stream of"),           # trailing bytes
    (_reply(b"not zlib at all"), "zlib"),
    ({"page": 12}, "no page"),
    ({"page": ["a"]}, "no page"),
    ({"page": "@@@@"}, "base64"),
    ({"page": "A" * (PAGE_REPLY_MAX * 2)}, "characters"),          # too big, never decoded
    ({}, "no page"),
    ([1, 2], "not an object"),
])
def test_a_reply_that_is_not_the_page_is_refused(reply: Any, why: str) -> None:
    with pytest.raises(PageRefused, match=why):
        parse_page_reply(reply, DIGEST, len(PAGE))


@FUZZ
@given(reply=json_values | st.fixed_dictionaries({"page": st.text(max_size=300)})
       | st.fixed_dictionaries({"page": st.binary(max_size=300).map(
           lambda b: base64.b64encode(b).decode())}))
def test_fuzz_parse_page_reply_refuses_or_returns_the_page(reply: Any) -> None:
    try:
        data = parse_page_reply(reply, DIGEST, len(PAGE))
    except PageRefused:
        return
    assert data is None or zlib.decompress(data) == PAGE


@FUZZ
@given(value=json_values | st.text(alphabet="0123456789abcdefABCDEF", min_size=60, max_size=70))
def test_fuzz_parse_page_hash_takes_only_64_lowercase_hex(value: Any) -> None:
    try:
        digest = parse_page_hash(value)
    except KspeedfsError:
        return
    assert digest.hex() == value


# -- the copy's directory ------------------------------------------------------------------


def test_the_copy_is_made_0700_and_refused_when_others_may_enter(tmp_path: Path) -> None:
    pc = _copy(tmp_path)
    pc._check()
    assert (os.stat(pc.directory).st_mode & 0o777) == 0o700
    os.chmod(pc.directory, 0o755)
    with pytest.raises(UnsafePath, match="cluster.page_copy: .* mode 0755"):
        _copy(tmp_path)._check()


def test_a_second_node_with_the_same_copy_is_refused_while_the_first_holds_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(page_copy, "COPY_LOCK_WAIT", 0.1)
    first = _copy(tmp_path)
    first._check()
    with pytest.raises(ConfigError, match="cluster.page_copy: .* another node"):
        _copy(tmp_path)._check()
    os.close(first._held)                                # the first node exits
    _copy(tmp_path)._check()


def test_a_copy_reached_through_a_symbolic_link_is_refused(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "copy").symlink_to(tmp_path / "real")
    with pytest.raises(UnsafePath, match="cluster.page_copy: .*symbolic link"):
        _copy(tmp_path)._check()


# -- answering and fetching over the node RPC ------------------------------------------------


@asynccontextmanager
async def _node(handler: rpc.Handler) -> AsyncIterator[NodeRecord]:
    async with trio.open_nursery() as n:
        listeners = await n.start(lambda task_status: rpc.serve(
            SECRET, "node", handler, 0, LO, task_status=task_status))
        port = listeners[0].socket.getsockname()[1]
        yield NodeRecord(node=f"n{port}", host="h", nics=[LO], port=1, rpc_port=port,
                         capacity=1, nslots=1, slot_size=1, nbuckets=1)
        n.cancel_scope.cancel()


def _answering(pc: PageCopy) -> rpc.Handler:
    async def handle(req: dict[str, Any]) -> dict[str, Any]:
        assert req.get("op") == "page"
        return await pc.answer(req.get("hash"))
    return handle


async def test_a_node_answers_from_its_copy_then_its_store_pages_else_absent(tmp_path: Path) -> None:
    store_pages = tmp_path / "store"
    blob, _ = write_pages([_raw(3 * PS)], str(store_pages), PS)
    root = Root.parse(blob)
    pc = _copy(tmp_path, str(store_pages))
    async with _node(_answering(pc)) as rec:
        client = rpc.RpcClient(SECRET, "asker", rec.nics, rec.rpc_port)
        reply = await client.request(page_request(root.tables[0]))
        assert parse_page_reply(reply, root.tables[0], 3 * 32) is not None
        assert await client.request(page_request(b"\x01" * 32)) == {"absent": True}
        with pytest.raises(rpc.RpcUnavailable, match="hex"):
            await client.request({"op": "page", "hash": "zz"})
        await client.aclose()
    assert pc.counters.pages_served == 1


async def test_a_fill_takes_each_page_from_the_next_peer_when_one_lies(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Peer "liar" answers every page with the wrong bytes, "holder" has store.pages: the
    copy gets every page, verified, each liar's answer refused and counted; the table
    pages come last, so a copy with the tables has every page."""
    raw = _raw(40 * PS + 5)
    blob, _ = write_pages([raw], str(tmp_path / "store"), PS)
    root = Root.parse(blob)
    holder = _copy(tmp_path / "h", str(tmp_path / "store"))

    async def lie(req: dict[str, Any]) -> dict[str, Any]:
        return _reply(zlib.compress(b"\0" * PS))

    order: list[str] = []

    def put(directory: str, digest: bytes, data: bytes) -> None:
        order.append("table" if digest in root.tables else "data")
        put_page(directory, digest, data)

    monkeypatch.setattr(page_copy, "put_page", put)

    async with _node(lie) as liar, _node(_answering(holder)) as good:
        membership = SimpleNamespace(members=[Member(liar.node), Member(good.node), Member("me")],
                                     nodes={liar.node: liar, good.node: good})
        clients = {r.node: rpc.RpcClient(SECRET, "me", r.nics, r.rpc_port) for r in (liar, good)}
        connections = SimpleNamespace(rpc=lambda rec: clients[rec.node])
        store = SimpleNamespace(manifest=lambda name, version: blob)
        pc = _copy(tmp_path, None, store=store, membership=membership, connections=connections)
        await pc.fill("ds", 1)
        for c in clients.values():
            await c.aclose()
    assert pc.counters.pages_from_peers == root.pages + len(root.tables) == len(order)
    assert pc.counters.pages_refused > 0 and pc.counters.pages_from_store == 0
    assert order[-len(root.tables):] == ["table"] * len(root.tables)
    assert "table" not in order[:-len(root.tables)]
    assert read_all(root, read_table(root, [pc.directory]), [pc.directory]) == raw


async def test_a_silent_peer_is_skipped_not_waited_for_page_after_page(tmp_path: Path) -> None:
    """A member that accepts connections and never answers (a node dead in its leave
    grace) costs one handshake deadline (2 s) per worker, then is skipped: 40 pages by
    4 workers end in well under the ~5 waves x 2 s that asking it for each would cost."""
    blob, _ = write_pages([_raw(39 * PS)], str(tmp_path / "store"), PS)
    holder = _copy(tmp_path / "h", str(tmp_path / "store"))
    async with trio.open_nursery() as n:
        silent = (await n.start(trio.serve_tcp, lambda s: trio.sleep_forever(), 0))[0]
        dead = NodeRecord(node="dead", host="h", nics=[LO], port=1,
                          rpc_port=silent.socket.getsockname()[1], capacity=1, nslots=1,
                          slot_size=1, nbuckets=1)
        async with _node(_answering(holder)) as good:
            membership = SimpleNamespace(members=[Member("dead"), Member(good.node)],
                                         nodes={"dead": dead, good.node: good})
            connections = Connections(None, SECRET, "me", 2.0, n)  # type: ignore[arg-type]
            pc = _copy(tmp_path, None, store=SimpleNamespace(manifest=lambda nm, v: blob),
                       membership=membership, connections=connections)
            t0 = trio.current_time()
            await pc.fill("ds", 1)
            took = trio.current_time() - t0
            await connections.aclose()
        n.cancel_scope.cancel()
    assert pc.counters.pages_from_peers == 40 and took < 6.0, took
    assert not connections.skipped("dead", time.monotonic())      # chunk reads unaffected


async def test_a_fill_with_no_peer_and_no_store_pages_fails_and_writes_no_table(tmp_path: Path) -> None:
    blob, _ = write_pages([_raw(5 * PS)], str(tmp_path / "store"), PS)
    membership = SimpleNamespace(members=[Member("me")], nodes={})
    pc = _copy(tmp_path, None, store=SimpleNamespace(manifest=lambda n, v: blob),
               membership=membership, connections=None)
    with pytest.raises(ManifestCorrupt, match="no peer has it, and this node has no store.pages"):
        await pc.fill("ds", 1)
    assert not any(os.scandir(pc.directory))


# -- the sweep --------------------------------------------------------------------------------


async def test_a_version_no_longer_preloaded_loses_its_pages_after_the_grace_and_its_mounts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store_pages = str(tmp_path / "store")
    blob_a, _ = write_pages([_raw(6 * PS)], store_pages, PS)
    blob_b, _ = write_pages([_raw(6 * PS, seed=2)], store_pages, PS)
    blobs = {1: blob_a, 2: blob_b}
    membership = SimpleNamespace(members=[Member("me")], nodes={})
    pc = _copy(tmp_path, store_pages, store=SimpleNamespace(manifest=lambda n, v: blobs[v]),
               membership=membership, connections=None)
    await pc.fill("ds", 1)
    await pc.fill("ds", 2)
    both = sum(len(files) for _, _, files in os.walk(pc.directory))
    held: dict[str, list[object]] = {"ds@1": [object()]}
    monkeypatch.setattr(page_copy.lifecycle, "mounts", lambda store: held)
    assert await pc.retain(["ds@2"], grace=3600) == 0           # gone, within the grace
    assert await pc.retain(["ds@2"], grace=0) == 0              # gone, a mount holds it
    assert sum(len(files) for _, _, files in os.walk(pc.directory)) == both
    held.clear()
    assert await pc.retain(["ds@2"], grace=0) > 0
    left = sum(len(files) for _, _, files in os.walk(pc.directory))
    root_b = Root.parse(blob_b)
    assert 0 < left < both
    read_all(root_b, read_table(root_b, [pc.directory]), [pc.directory])   # b whole


# -- a mount's page directories ----------------------------------------------------------------


def _cfg(tmp_path: Path, copy: str, pages: str = "") -> Config:
    cfg = Config()
    cfg.store.backend, cfg.store.etcd, cfg.store.pages = "etcd", ["http://127.0.0.1:1"], pages
    cfg.cluster.page_copy = copy
    return cfg


def test_a_mount_lists_its_hosts_copy_first_and_waits_only_without_store_pages(tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    assert page_dirs(_cfg(tmp_path, str(copy))) == []                  # no node here
    copy.mkdir()
    cfg = _cfg(tmp_path, str(copy), "/shared/pages")
    assert page_dirs(cfg) == [str(copy), "/shared/pages"]
    assert mount_wait(cfg, page_dirs(cfg)) == 0
    alone = _cfg(tmp_path, str(copy))
    assert page_dirs(alone) == [str(copy)] and mount_wait(alone, page_dirs(alone)) > 0


def test_a_mount_whose_node_has_not_copied_the_pages_fails_with_one_line(tmp_path: Path) -> None:
    blob, _ = write_pages([_raw(3 * PS)], str(tmp_path / "elsewhere"), PS)
    info = DatasetInfo(name="ds", version=4, files=1, entries=1, bytes=1, chunks=1,
                       chunk_size=PS, imported_at=0.0, source="/x", inflated_size=3 * PS)
    (tmp_path / "copy").mkdir()
    with pytest.raises(ManifestCorrupt) as e:
        open_index(blob, info, [str(tmp_path / "copy")], 1 << 20, wait=0.6)
    assert "\n" not in str(e.value) and "after 1s" in str(e.value)
    assert "kspeedfs preload ds" in str(e.value)
    with pytest.raises(ManifestCorrupt, match="no page directory is here"):
        open_index(blob, info, [], 1 << 20)


def test_a_mount_waits_for_its_nodes_copy_and_goes_on_once_the_tables_are_there(
        tmp_path: Path) -> None:
    blob, _ = write_pages([_raw(3 * PS)], str(tmp_path / "elsewhere"), PS)
    info = DatasetInfo(name="ds", version=4, files=1, entries=1, bytes=1, chunks=1,
                       chunk_size=PS, imported_at=0.0, source="/x", inflated_size=3 * PS)
    copy = tmp_path / "copy"
    timer = threading.Timer(0.8, shutil.copytree, (tmp_path / "elsewhere", copy),
                            {"dirs_exist_ok": True})
    copy.mkdir()
    timer.start()
    try:
        t0 = time.monotonic()
        hashes = load._table(Root.parse(blob), info, [str(copy)], wait=20)
        assert 0.7 < time.monotonic() - t0 < 10
        assert hashes == read_table(Root.parse(blob), [str(tmp_path / "elsewhere")])
    finally:
        timer.join()


def test_page_path_is_the_same_in_the_copy_as_in_store_pages(tmp_path: Path) -> None:
    assert page_path(str(tmp_path), DIGEST).endswith(f"/{DIGEST.hex()[:2]}/{DIGEST.hex()}")


def test_one_page_written_by_many_threads_at_once_is_always_whole(tmp_path: Path) -> None:
    """A node's fill and a mount's ask may write the same page at once: a reader never
    sees half of it (each write has a temporary name of its own)."""
    page = random.Random(9).randbytes(256 << 10)
    digest, data = hashlib.sha256(page).digest(), zlib.compress(page, 0)
    stop, bad = threading.Event(), []

    def write() -> None:
        while not stop.is_set():
            put_page(str(tmp_path), digest, data)

    def read() -> None:
        while not stop.is_set():
            try:
                with open(page_path(str(tmp_path), digest), "rb") as f:
                    got = f.read()
            except FileNotFoundError:
                continue
            if got != data:
                bad.append(len(got))

    threads = [threading.Thread(target=write) for _ in range(4)] + [threading.Thread(target=read)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    stop.set()
    for t in threads:
        t.join()
    assert not bad, f"{len(bad)} partial reads"
