"""The library's async reads (``Dataset.aread``, ``aread_many``): from asyncio and from
trio, the same bytes and errors as the synchronous calls, reads of one batch overlapped,
the caller's event loop free while a load runs in the dataset's trio thread, a
cancelled caller leaving the handle usable, a closed handle refused.

A real source tree in a real embedded store (``test_client.py``'s), no mount."""
from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import pytest
import trio

import kspeedfs
from kspeedfs.client.reads import FileReads
from tests.fixtures.mounts import files_below

from .test_client import _config, tree  # noqa: F401


@pytest.fixture(params=["512MiB", "8MiB"], ids=["resident", "transient"])
def ds(tree, request):  # noqa: F811
    _, store = tree
    with kspeedfs.open_dataset("tree", config=_config(store, request.param)) as d:
        yield d


def _want(src: Path, p: bytes | str) -> bytes:
    return (src / os.fsdecode(p)).read_bytes()


def test_asyncio_reads_every_file_as_the_sync_api_does(tree, ds) -> None:  # noqa: F811
    src, _ = tree
    paths = files_below(src)

    async def main() -> None:
        for p in paths[:40]:
            assert await ds.aread(p) == _want(src, p), p
        assert await ds.aread(paths[0], 3, 10) == _want(src, paths[0])[3:13]
        many = await ds.aread_many(paths)
        assert many == [_want(src, p) for p in paths]

    asyncio.run(main())


def test_trio_reads_every_file_as_the_sync_api_does(tree, ds) -> None:  # noqa: F811
    src, _ = tree
    paths = files_below(src)

    async def main() -> None:
        got: dict[bytes, bytes] = {}

        async def one(p: bytes) -> None:
            got[p] = await ds.aread(p)
        async with trio.open_nursery() as n:            # many tasks at once
            for p in paths[:60]:
                n.start_soon(one, p)
        assert got == {p: _want(src, p) for p in paths[:60]}
        assert await ds.aread_many(paths[60:]) == [_want(src, p) for p in paths[60:]]

    trio.run(main)


def test_errors_are_those_of_open_on_a_mount(ds) -> None:
    async def main() -> None:
        with pytest.raises(FileNotFoundError):
            await ds.aread("no/such/file")
        with pytest.raises(IsADirectoryError):
            await ds.aread("")
        out = await ds.aread_many(["no/such", "many-chunks.bin"], return_exceptions=True)
        assert isinstance(out[0], FileNotFoundError) and len(out[1]) > 0
        with pytest.raises(ValueError):
            await ds.aread("many-chunks.bin", -1)

    asyncio.run(main())


def _hold_loads(monkeypatch: pytest.MonkeyPatch, seconds: float) -> threading.Event:
    """Every load the loop makes waits ``seconds`` first (a slow tier); the event is set
    when the first one starts."""
    slow, started = FileReads._read, threading.Event()

    async def held(self, *args):
        started.set()
        await trio.sleep(seconds)
        return await slow(self, *args)
    monkeypatch.setattr(FileReads, "_read", held)
    return started


def test_the_callers_event_loop_runs_while_a_load_waits(tree, monkeypatch) -> None:  # noqa: F811
    """A load held up in the loop: the asyncio caller's other tasks go on meanwhile,
    which a blocking call in the event loop's thread would stop."""
    _, store = tree
    _hold_loads(monkeypatch, 0.3)
    with kspeedfs.open_dataset("tree", config=_config(store, "8MiB")) as d:
        async def main() -> int:
            ticks = 0

            async def ticker() -> None:
                nonlocal ticks
                while True:
                    await asyncio.sleep(0.01)
                    ticks += 1
            t = asyncio.create_task(ticker())
            await d.aread("many-chunks.bin", 0, 4096)
            t.cancel()
            return ticks
        assert asyncio.run(main()) >= 10


def test_a_cancelled_caller_leaves_the_handle_usable(tree, monkeypatch) -> None:  # noqa: F811
    src, store = tree
    started = _hold_loads(monkeypatch, 0.5)
    with kspeedfs.open_dataset("tree", config=_config(store, "8MiB")) as d:
        async def main() -> None:
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(d.aread("many-chunks.bin", 0, 4096), 0.1)
            assert started.is_set()
            assert await d.aread("many-chunks.bin", 0, 4096) == _want(src, "many-chunks.bin")[:4096]
        t0 = time.monotonic()
        asyncio.run(main())
        assert time.monotonic() - t0 < 5


def test_a_closed_handle_is_refused_and_a_read_it_cut_short_raises(tree, monkeypatch) -> None:  # noqa: F811
    _, store = tree
    d = kspeedfs.open_dataset("tree", config=_config(store))
    d.close()
    with pytest.raises(ValueError, match="closed"):
        asyncio.run(d.aread("many-chunks.bin"))

    started = _hold_loads(monkeypatch, 30)
    d = kspeedfs.open_dataset("tree", config=_config(store, "8MiB"))

    async def main() -> None:
        closer = threading.Thread(target=lambda: (started.wait(10), d.close()))
        closer.start()
        with pytest.raises(ValueError, match="closed"):
            await d.aread("many-chunks.bin", 0, 4096)
        closer.join()
    asyncio.run(main())
