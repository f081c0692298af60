"""④⑤ The loads a tier chain hands to C, and the READs that go with them.

On a native-engine cluster mount without a disk tier the native fetch (a
``NativeLoader``) READs a replica's chunk, small file's extent or block in C, verifies it
and puts it into the memory tier there. The chain (``tiers.py``) asks this module first:

    TierChain.chunk / start / extent        NativeHandoff.chunk / start / extent: C takes
                                            the load if it may (``_take``); the chain
                                            waits, then finds the bytes in the memory
                                            tier or loads them its own way
    TierChain.start_extent / start_block    the extent or block, with the READ that wants
                                            it: C answers that READ
    TierChain.hand_chunks                   a sequential READ, parked in C on its chunks

One rule decides whether C takes a key (``_take``): C has it in flight already, or no
load of it runs in the chain's single-flight and there is no disk tier (which comes
before peers). Nothing here names the cluster: the loader is a protocol.
"""
from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

from ..manifest.index import ManifestIndex
from .singleflight import SingleFlight

if TYPE_CHECKING:
    from ..manifest.model import Extent
    from .tiers import MemoryTier


class NativeLoader(Protocol):
    """Loads the chain hands to C: a chunk, a small file's extent or a block READ from a
    replica, verified and put into the memory tier there; a READ handed with it is
    answered there too. The native engine's fetch, on a native-engine cluster mount.
    Every ``start*`` says whether C took the load (False: the chain's own path takes it)."""

    @property
    def inflight(self) -> Container[bytes]: ...    # keys whose load C has in flight

    def start(self, k: int, key: bytes) -> bool: ...

    def start_extent(self, k: int, ext: Extent, read: tuple[Any, ...] | None = None) -> bool: ...

    def start_block(self, k: int, b: int, key: bytes, entry: int,
                    read: tuple[Any, ...]) -> bool: ...

    def failed_lately(self, key: bytes) -> bool: ...

    def read_or_park(self, entry: int, read: tuple[Any, ...]) -> bool: ...

    async def wait(self, key: bytes) -> None: ...


class NativeHandoff:
    """Which of one tier chain's loads, and which queued READs, go to ``native``.

    A key goes to C only when the memory tier lacks it and ``_take``'s rule allows; an
    extent or a block handed with its READ (``start_extent``, ``start_block``) also
    needs C not to be loading it yet (a load in flight there takes no READ). Every
    method that hands says whether C took it; False: the caller's own path takes it
    (and answers the READ). Owns nothing: the memory tier and the single-flight are the
    chain's. Trio thread only.

    Attributes:
        native: the native fetch.
        index, memory, flights: the chain's manifest, memory tier and single-flight.
        disk: whether the chain has a disk tier (then C takes no load: disk comes first).
    """

    def __init__(self, native: NativeLoader, *, index: ManifestIndex, memory: MemoryTier,
                 flights: SingleFlight[Any], disk: bool) -> None:
        self.native = native
        self.index = index
        self.memory = memory
        self.flights = flights
        self.disk = disk

    def in_flight(self, key: bytes) -> bool:
        """Whether C is loading ``key``."""
        return key in self.native.inflight

    def start(self, k: int, key: bytes) -> bool:
        """Whether C loads chunk ``k`` (digest ``key``): started now or in flight there."""
        return self._take(key, partial(self.native.start, k, key))

    async def chunk(self, k: int, key: bytes) -> None:
        """Unless the memory tier has chunk ``k``: C's load of it, if C takes it, waited
        for."""
        await self._wait(key, partial(self.native.start, k, key))

    async def extent(self, k: int, ext: Extent) -> None:
        """The same for small file ``ext.entry``'s one extent, in chunk ``k``."""
        await self._wait(ext.digest, partial(self.native.start_extent, k, ext))

    def start_extent(self, k: int, ext: Extent, read: tuple[Any, ...]) -> bool:
        """Hand small file ``ext.entry``'s extent and ``read``, a READ of it the native
        engine queued, to C, which answers the READ (``NativeFetch.start_extent``);
        False: nothing was handed (in the memory tier, loading, or no route)."""
        return self._hand(ext.digest, partial(self.native.start_extent, k, ext, read))

    def start_block(self, k: int, b: int, key: bytes, entry: int, read: tuple[Any, ...]) -> bool:
        """The same for block ``b`` of chunk ``k`` (tier key ``key``) and ``read``, a
        random READ of ``entry`` inside it (``NativeFetch.start_block``)."""
        return self._hand(key, partial(self.native.start_block, k, b, key, entry, read))

    def hand_chunks(self, ks: Sequence[int], entry: int, read: tuple[Any, ...]) -> bool:
        """Hand ``read``, a sequential READ of ``entry`` over chunks ``ks`` that the native
        engine queued, to C: each chunk not in the memory tier started there (or in
        flight there already), the READ parked in C on them (``NativeFetch.read_or_park``).
        False: nothing parked (a chunk loading here, on the disk tier, with no route, or
        whose native fetch just failed); chunks started meanwhile go on loading."""
        native = self.native
        for k in ks:
            key = self.index.chunk_digest(k)
            if key in self.memory:
                continue
            if native.failed_lately(key) or not self._take(key, partial(native.start, k, key)):
                return False
        return native.read_or_park(entry, read)

    async def _wait(self, key: bytes, start: Callable[[], bool]) -> None:
        """Unless the memory tier has ``key``: C's load of it (``_take``), waited for."""
        if key not in self.memory and self._take(key, start):
            await self.native.wait(key)

    def _hand(self, key: bytes, start: Callable[[], bool]) -> bool:
        return key not in self.memory and key not in self.native.inflight and \
            self._take(key, start)

    def _take(self, key: bytes, start: Callable[[], bool]) -> bool:
        """Whether C has ``key`` (a chunk, or an extent): in flight there already, or
        handed to it now by ``start()``, unless a load of it runs here (or the disk tier,
        which comes before peers, is on)."""
        if key in self.native.inflight:
            return True
        if self.disk or self.flights.in_flight(key):
            return False
        return start()
