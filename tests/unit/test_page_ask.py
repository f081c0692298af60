"""A mount's page map asks its host's node for a page no directory holds
(kspeedfs/cluster/page_ask.py, native/manifest_pager.c ``ask``): real page maps
(userfaultfd) and a real node-side ask server on a unix socket; the request parser
fuzzed."""
from __future__ import annotations

import hashlib
import json
import os
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kspeedfs.cluster.node_stats import NodeCounters
from kspeedfs.cluster.page_ask import PageAsks
from kspeedfs.cluster.page_copy import PageCopy
from kspeedfs.cluster.placement import Member
from kspeedfs.errors import KspeedfsError
from kspeedfs.manifest.ask import ask_page, ask_path, parse_ask
from kspeedfs.manifest.pages import MAX_PAGE, Root, page_path, read_table, write_pages

PS = 4096
ROOT = Path(__file__).resolve().parents[2]
pager = pytest.importorskip("kspeedfs.manifest.pager")


def _copy(tmp_path: Path, store_pages: str | None) -> PageCopy:
    return PageCopy(str(tmp_path / "copy"), store_pages, "me", None,  # type: ignore[arg-type]
                    SimpleNamespace(members=[Member("me")], nodes={}),  # type: ignore[arg-type]
                    None, NodeCounters(), 2)  # type: ignore[arg-type]


#: the mount's side, in a process of its own: a fault blocks its reader in the kernel
#: holding the GIL, so the node answering the ask must be another process (as it is)
READER = """
import json, sys
from kspeedfs.manifest.pager import PageMap
size, hashes, copy, ask = int(sys.argv[1]), bytes.fromhex(sys.argv[2]), sys.argv[3], sys.argv[4]
pm = PageMap(size, 4096, hashes, [copy], 1 << 20, ask=ask, ask_ms=3000)
got = bytes(pm.view())
print(json.dumps({"got": got.hex(), "stats": pm.stats(), "failure": pm.failure}))
"""


async def _map_read(tmp_path: Path, store_pages: str | None, raw: bytes,
                    serve: bool = True) -> tuple[bytes, dict[str, int], str | None, PageCopy]:
    """``raw``'s pages in store.pages; a node's copy with none of them; a page map over
    the copy alone that asks the node, in another process: read it whole."""
    blob, _ = write_pages([raw], str(tmp_path / "store"), PS)
    root = Root.parse(blob)
    pc = _copy(tmp_path, store_pages)
    pc._check()
    pc.checked.set()
    hashes = read_table(root, [str(tmp_path / "store")])
    async with trio.open_nursery() as n:
        if serve:
            n.start_soon(PageAsks(pc).serve)
            while not os.path.exists(ask_path(pc.directory)):
                await trio.sleep(0.01)
        done = await trio.run_process(
            [sys.executable, "-c", READER, str(root.raw_size), hashes.hex(), pc.directory,
             ask_path(pc.directory)], capture_stdout=True, cwd=str(ROOT))
        n.cancel_scope.cancel()
    out = json.loads(done.stdout)
    return bytes.fromhex(out["got"]), out["stats"], out["failure"], pc


async def test_a_page_missing_from_the_copy_is_asked_of_the_node_and_read(tmp_path: Path) -> None:
    raw = random.Random(3).randbytes(9 * PS + 100)
    got, stats, failure, pc = await _map_read(tmp_path, str(tmp_path / "store"), raw)
    assert got == raw and failure is None
    assert stats["asks"] == 10 and stats["fills"] == 10 and stats["failures"] == 0
    assert pc.counters.pages_from_store == 10
    for i in range(10):                              # the node wrote each to the copy
        assert os.path.exists(page_path(pc.directory, hashlib.sha256(raw[i * PS:(i + 1) * PS]).digest()))


async def test_a_damaged_page_in_the_copy_is_replaced_when_a_mount_asks(tmp_path: Path) -> None:
    raw = random.Random(7).randbytes(3 * PS)
    first = hashlib.sha256(raw[:PS]).digest()
    damaged = page_path(str(tmp_path / "copy"), first)
    os.makedirs(os.path.dirname(damaged), mode=0o700)
    os.chmod(tmp_path / "copy", 0o700)
    Path(damaged).write_bytes(b"not a page")
    got, stats, failure, pc = await _map_read(tmp_path, str(tmp_path / "store"), raw)
    assert got == raw and failure is None and stats["asks"] == 3
    assert pc.counters.pages_from_store == 3


async def test_a_page_the_node_cannot_get_fails_the_map_closed_naming_the_ask(tmp_path: Path) -> None:
    raw = random.Random(4).randbytes(2 * PS)
    _, stats, failure, _ = await _map_read(tmp_path, None, raw)   # no store.pages, no peer
    assert failure is not None and "the node has none" in failure
    assert stats["failures"] >= 1


async def test_no_node_listening_fails_the_map_closed_at_once(tmp_path: Path) -> None:
    raw = random.Random(5).randbytes(2 * PS)
    with trio.fail_after(20):
        _, stats, failure, _ = await _map_read(tmp_path, None, raw, serve=False)
    assert failure is not None and "ask" in failure and stats["failures"] >= 1


def test_a_page_map_refuses_an_ask_path_too_long_for_a_socket(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="ask"):
        pager.PageMap(PS, PS, b"\0" * 32, [str(tmp_path)], 1 << 20, ask="/x" * 100)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=st.binary(max_size=64) | st.binary(min_size=32, max_size=32).flatmap(
    lambda h: st.integers(0, 1 << 64 - 1).map(lambda n: h + n.to_bytes(8, "little"))))
def test_fuzz_parse_ask_takes_only_a_hash_and_a_page_length(raw: bytes) -> None:
    try:
        digest, length = parse_ask(raw)
    except KspeedfsError:
        return
    assert len(raw) == 40 and digest == raw[:32] and 1 <= length <= MAX_PAGE


async def test_a_mount_asks_the_node_for_the_table_pages_it_lacks(tmp_path: Path) -> None:
    from kspeedfs.manifest import load
    from kspeedfs.manifest.store.base import DatasetInfo

    blob, _ = write_pages([random.Random(6).randbytes(5 * PS)], str(tmp_path / "store"), PS)
    root = Root.parse(blob)
    info = DatasetInfo(name="ds", version=1, files=1, entries=1, bytes=1, chunks=1,
                       chunk_size=PS, imported_at=0.0, source="/x")
    pc = _copy(tmp_path, str(tmp_path / "store"))
    pc._check()
    pc.checked.set()
    async with trio.open_nursery() as n:
        n.start_soon(PageAsks(pc).serve)
        while not os.path.exists(ask_path(pc.directory)):
            await trio.sleep(0.01)
        hashes = await trio.to_thread.run_sync(load._table, root, info, [pc.directory], 0,
                                               ask_path(pc.directory))
        n.cancel_scope.cancel()
    assert hashes == read_table(root, [str(tmp_path / "store")])
    assert pc.counters.pages_from_store == len(root.tables)
    assert not ask_page(str(tmp_path / "nobody"), root.tables[0], 32, 0.5)   # no node: False
