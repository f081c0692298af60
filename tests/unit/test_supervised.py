"""The daemon's side of its supervisor (fuse/supervisor.py ``Supervised``) over real
socketpairs: a supervisor whose end closes is replaced, ``bye`` reaches the current one and
starts none after it, and a supervisor that keeps dying is given up on (the mount serves
on). The whole double fault on a real mount: tests/mount/test_upgrade.py."""
from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest
import trio

from kspeedfs.fuse import supervisor
from kspeedfs.fuse.supervisor import Supervised
from kspeedfs.tuning import MAX_RESTARTS


class Starts:
    """``start()`` for ``Supervised``: a new socketpair each call, the far ends kept (they
    play the supervisors); ``fail`` calls raise first."""

    def __init__(self) -> None:
        self.theirs: list[socket.socket] = []
        self.fail = 0

    def __call__(self) -> trio.socket.SocketType:
        if self.fail:
            self.fail -= 1
            raise OSError("no supervisor today")
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.theirs.append(theirs)
        return trio.socket.from_stdlib_socket(mine)


@pytest.fixture
def starts() -> Iterator[Starts]:
    s = Starts()
    yield s
    for sock in s.theirs:
        sock.close()


async def _until(predicate, timeout: float = 5.0) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.01)


async def test_a_supervisor_that_dies_is_replaced_and_bye_goes_to_the_new_one(starts: Starts) -> None:
    supervised = Supervised("/mnt/x", starts(), starts)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(supervised.watch)
        starts.theirs[0].close()                          # SIGKILL of the first one
        await _until(lambda: len(starts.theirs) == 2)
        await supervised.bye("unmounted")
    assert json.loads(starts.theirs[1].recv(1024)) == {"bye": True, "why": "unmounted"}
    assert starts.theirs[1].recv(1024) == b""             # closed after it
    assert len(starts.theirs) == 2 and supervised.control is None


async def test_after_bye_a_supervisor_that_leaves_is_not_replaced(starts: Starts) -> None:
    supervised = Supervised("/mnt/x", starts(), starts)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(supervised.watch)
        await trio.sleep(0.05)
        await supervised.bye("handed over")
        starts.theirs[0].close()                          # it exits on bye, as a real one does
        await trio.sleep(0.1)
    assert len(starts.theirs) == 1


async def test_a_supervisor_that_keeps_dying_is_given_up_on(
        starts: Starts, caplog: pytest.LogCaptureFixture) -> None:
    supervised = Supervised("/mnt/x", starts(), starts)
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(supervised.watch)
            for i in range(MAX_RESTARTS + 1):
                await _until(lambda i=i: len(starts.theirs) == i + 1)
                starts.theirs[i].close()
    # watch returned by itself: MAX_RESTARTS new ones, then none
    assert len(starts.theirs) == MAX_RESTARTS + 1 and supervised.control is None
    assert "serves on unsupervised" in caplog.text


async def test_a_supervisor_that_cannot_start_is_tried_again(
        starts: Starts, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervisor, "RESUME_BACKOFF", 0.01)
    supervised = Supervised("/mnt/x", starts(), starts)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(supervised.watch)
        starts.fail = 2
        starts.theirs[0].close()
        await _until(lambda: len(starts.theirs) == 2)
        await supervised.bye("unmounted")
    assert starts.fail == 0 and json.loads(starts.theirs[1].recv(1024))["bye"] is True
