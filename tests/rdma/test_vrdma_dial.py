"""dial(): every address of a peer at once, the first to answer wins.

The race logic on its own, with attempts that hang, fail or succeed on cue (the real
sockets are exercised by the netns cluster tests, which cut a NIC).
"""
from __future__ import annotations

import pytest
import trio

from rdma.errors import AuthenticationError
from rdma.vrdma.dial import DialFailed, dial


async def test_a_hanging_first_address_does_not_delay_the_live_one() -> None:
    async def attempt(addr: str) -> str:
        if addr == "dead":
            await trio.sleep_forever()        # a SYN into a downed link
        await trio.sleep(0.01)
        return addr

    with trio.fail_after(1):
        t0 = trio.current_time()
        assert await dial(["dead", "live"], attempt) == "live"
        assert trio.current_time() - t0 < 0.5


async def test_every_address_failing_names_each() -> None:
    async def attempt(addr: str) -> str:
        raise OSError(113, f"No route to host ({addr})")

    with pytest.raises(DialFailed) as e:
        await dial(["a", "b"], attempt)
    assert len(e.value.errors) == 2 and "a: OSError" in str(e.value)


async def test_a_late_second_winner_is_closed() -> None:
    closed: list[str] = []

    async def attempt(addr: str) -> str:
        with trio.CancelScope(shield=True):   # finishes even though it lost
            await trio.sleep(0.01 if addr == "a" else 0.02)
        return addr

    async def close(got: str) -> None:
        closed.append(got)

    assert await dial(["a", "b"], attempt, close) == "a"
    assert closed == ["b"]


async def test_authentication_failure_is_not_hidden_by_another_address() -> None:
    async def attempt(addr: str) -> str:
        if addr == "a":
            raise AuthenticationError("bad secret")
        await trio.sleep_forever()

    with trio.fail_after(1), pytest.raises(AuthenticationError):
        await dial(["a", "b"], attempt)


async def test_the_callers_deadline_bounds_the_dial() -> None:
    async def attempt(addr: str) -> str:
        await trio.sleep_forever()

    with pytest.raises(trio.TooSlowError):     # the caller's own timeout, as usual
        with trio.fail_after(0.05):
            await dial(["a", "b"], attempt)
