"""⑤ The fetches the native engine has out (:mod:`.native_fetch`): one record each.

    Fetch              one chunk (or small file's extent, or block) C is READing
    InFlight           the records by key and by cookie, the late ones per node, and the
                       keys whose fetch failed lately (their READs take Python's path)
    give_slot(...)     the slot of a fetch that is over back to its pool
    fe                 the native engine's module (FETCHED statuses and cookie bits,
                       native/fuse_fetch.h), or None in a checkout that did not build it
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from ..landing import Slot
from ...tuning import NATIVE_FAILED_FOR, NATIVE_READS

if TYPE_CHECKING:
    from rdma.vrdma import VQP

    from ..fetch import Peers

__all__ = ["NATIVE_FAILED_FOR", "Fetch", "InFlight", "fe", "give_slot"]

try:
    # FETCHED statuses (native/fuse_fetch.h); the C extension has no stubs
    from ...fuse import _engine as fe  # type: ignore[attr-defined]
except ImportError:                        # a checkout whose native code was not built
    fe = None


@dataclass(slots=True)
class Fetch:
    """One chunk (or small file's extent) C is READing: where it lands, from which
    incarnation of which node (for its hint), and the Event of whoever waits for it."""

    k: int
    key: bytes                              # what the memory tier keeps it under
    slot: Slot | None                       # a landing slot; an extent's: a staging slot
                                            # (None: C's own, an extent C started)
    length: int
    node: str
    started: float
    t0: float                               # when it was posted (time.monotonic)
    cookie: int
    vqp: VQP
    qpn: int                                # the path it was posted on
    chunk_key: bytes                        # its chunk's digest (the slot hint's key)
    offset: int = 0                         # a part's offset in its chunk
    extent: bool = False                    # a part (an extent, a block), not a chunk
    want: bytes = b""                       # a part's digest (an extent's is its key)
    event: trio.Event | None = None
    delivered: bool = False                 # a hedge put its bytes: nobody waits for it
    landed: bool = False                    # C's READ landed verified (before any hedge)
    hedged: bool = False
    late: bool = False                      # past its hedging deadline, not back yet


class InFlight:
    """The records of the fetches C has out, for one mount.

    Contract: a record is in ``by_key`` and ``by_cookie`` from ``add`` until ``pop`` of
    its cookie (read the two maps; change them only through those); ``late[node]``
    counts that node's records past their hedging deadline (``overdue``) until they are
    popped; a key ``failed`` is ``failed_lately`` for NATIVE_FAILED_FOR seconds (at most
    ``NATIVE_READS × 8`` keys are remembered). Trio thread only.
    """

    def __init__(self) -> None:
        self.by_key: dict[bytes, Fetch] = {}
        self.by_cookie: dict[int, Fetch] = {}
        self.late: Counter[str] = Counter()    # node → its fetches past their deadline
        self._failed: dict[bytes, float] = {}  # key → when its fetch last failed

    def add(self, f: Fetch) -> None:
        self.by_key[f.key] = self.by_cookie[f.cookie] = f

    def pop(self, cookie: int) -> Fetch | None:
        """The record of ``cookie``, out of the maps (and of ``late``); None if none."""
        f = self.by_cookie.pop(cookie, None)
        if f is None:
            return None
        del self.by_key[f.key]
        if f.late:
            self.late[f.node] -= 1
        return f

    def overdue(self, f: Fetch) -> None:
        """``f`` passed its hedging deadline (once)."""
        f.late = True
        self.late[f.node] += 1

    def failed(self, key: bytes) -> None:
        """The fetch of ``key`` failed: its READ takes Python's path for NATIVE_FAILED_FOR s."""
        if len(self._failed) >= NATIVE_READS * 8:
            self._failed.clear()
        self._failed[key] = time.monotonic()

    def failed_lately(self, key: bytes) -> bool:
        return time.monotonic() - self._failed.get(key, -NATIVE_FAILED_FOR) < NATIVE_FAILED_FOR


def give_slot(peers: Peers, slot: Slot | None, staging: bool) -> None:
    """A slot whose READ is over back to its pool: ``staging`` or landing (None: C's
    staging slot, C's)."""
    if slot is None:
        return
    if staging:
        peers.give_staging(slot)
    else:
        peers.landing.give(slot)
