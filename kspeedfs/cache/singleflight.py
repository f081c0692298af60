"""Single-flight: concurrent requests for one chunk share one load.

The first caller for a key runs the load in the flight's own nursery task (so a
cancelled reader — say the kernel interrupted a read — does not cancel the load the
others wait for); later callers wait on the same ``trio.Event``. The result, or the
exception, is handed to every waiter, then forgotten: caching is the caller's job.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import trio

from ..errors import LoadCancelled

T = TypeVar("T")


class _Flight(Generic[T]):
    def __init__(self) -> None:
        self.done = trio.Event()
        self.result: T | None = None
        self.error: BaseException | None = None


class SingleFlight(Generic[T]):
    """One load per key at a time; ``nursery`` runs the loads (and may run other
    background work of the same lifetime, such as a disk-tier write-back)."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery
        self._flights: dict[Any, _Flight[T]] = {}

    def in_flight(self, key: Any) -> bool:
        return key in self._flights

    def start(self, key: Any, load: Callable[..., Awaitable[T]], *args: Any) -> tuple[_Flight[T], bool]:
        """Start (or join) the load of ``key``; returns the flight and whether it is new."""
        flight = self._flights.get(key)
        if flight is not None:
            return flight, False
        flight = self._flights[key] = _Flight()

        async def run() -> None:
            try:
                flight.result = await load(*args)
            except Exception as e:   # handed to the waiters, who raise it
                flight.error = e
            except BaseException:    # cancelled: the waiters must not take None for a result
                flight.error = LoadCancelled(f"load of {key!r} was cancelled")
                raise
            finally:
                del self._flights[key]
                flight.done.set()

        self.nursery.start_soon(run, name=f"load-{key.hex()[:12] if isinstance(key, bytes) else key}")
        return flight, True

    async def run(self, key: Any, load: Callable[..., Awaitable[T]], *args: Any) -> tuple[T, bool]:
        """Result of the (shared) load and whether this caller joined an existing flight."""
        flight, new = self.start(key, load, *args)
        await flight.done.wait()
        if flight.error is not None:
            raise flight.error
        return flight.result, not new  # type: ignore[return-value]
