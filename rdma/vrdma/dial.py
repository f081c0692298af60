"""Dial a peer at any of its NICs: every address at once, the first to answer wins.

Why at once and not in turn: a peer is reachable at one address per NIC, and the reason
to have several NICs is that one of them may be dead. Tried in turn, a dead first
address costs its whole connect timeout (a SYN into a downed link is retried, and ARP
for a neighbour behind it fails only after seconds) before the live one is even tried;
measured with a client NIC flapping, that sent every chunk read of the outage to the
source. Dialled together, a live NIC answers in one round trip whatever the others do.

An attempt that succeeds after the winner is closed (``close``); an
:class:`~rdma.errors.AuthenticationError` is not a reachability problem and is raised
at once (the peer answered, and refused us).
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import trio

from ..errors import AuthenticationError, HandshakeError

T = TypeVar("T")

#: what a failed attempt may raise and still leave the other addresses worth trying
UNREACHABLE = (OSError, HandshakeError, trio.TooSlowError)


class DialFailed(Exception):
    """No address answered; ``errors`` says why for each."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("; ".join(errors) or "timed out")
        self.errors = errors


async def _discard(_: object) -> None:
    pass


async def dial(addrs: Sequence[str], attempt: Callable[[str], Awaitable[T]],
               close: Callable[[T], Awaitable[None]] = _discard) -> T:
    """The result of the first ``attempt(addr)`` to succeed; the others are cancelled.
    Raises :class:`DialFailed` when every attempt failed (or the caller's deadline hit)."""
    won: list[T] = []
    errors: list[str] = []
    refused: list[AuthenticationError] = []

    async with trio.open_nursery() as nursery:
        async def one(addr: str) -> None:
            try:
                got = await attempt(addr)
            except AuthenticationError as e:
                refused.append(e)
                nursery.cancel_scope.cancel()
                return
            except UNREACHABLE as e:
                errors.append(f"{addr}: {type(e).__name__}: {e}")
                return
            if won:                                   # lost the race: give it back
                with trio.CancelScope(shield=True):
                    await close(got)
                return
            won.append(got)
            nursery.cancel_scope.cancel()

        for addr in addrs:
            nursery.start_soon(one, addr)
    if refused:
        raise refused[0]
    if not won:
        raise DialFailed(errors)
    return won[0]
