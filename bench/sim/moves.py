"""Placement moves on a membership change, counted with ``placement.owners`` itself.

A *replica move* is one (chunk, node) pair that is an owner after the change and was
not before: a node that has to load the chunk. Rendezvous hashing promises that a
leaving node's replicas move and nothing else does, and that a joining node takes
only replicas it now out-scores someone for: the moved share of all R × chunks
replicas is then ≈ 1/N (a leaver held 1/N of them), and ``foreign`` — moves that
neither come from the leaver nor go to the joiner — is 0.
"""
from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from kspeedfs.cluster.placement import Member, owners


@dataclass(frozen=True)
class Moves:
    chunks: int
    replicas: int             # R
    moved: int                # replica moves (new (chunk, owner) pairs)
    touched: int              # chunks with at least one new owner
    foreign: int              # moves that involve neither the leaver nor the joiner
    members_after: int

    @property
    def moved_fraction(self) -> float:
        """Moved replicas over all replicas: ≈ 1/N for one node joining or leaving."""
        return self.moved / (self.chunks * self.replicas)

    @property
    def touched_fraction(self) -> float:
        """Chunks that gain an owner: ≈ R/N."""
        return self.touched / self.chunks

    def expected(self, n: int) -> tuple[float, float]:
        """1/n and one binomial standard deviation of ``moved_fraction`` around it."""
        p, total = 1 / n, self.chunks * self.replicas
        return p, math.sqrt(p * (1 - p) / total)


def chunk_keys(count: int, salt: int = 0) -> list[bytes]:
    """``count`` synthetic chunk keys (16 bytes, like an xxh3-128 digest)."""
    return [struct.pack("<QQ", i, salt ^ 0x9E3779B97F4A7C15) for i in range(count)]


def moves(keys: Sequence[bytes], before: Sequence[Member], after: Sequence[Member],
          replicas: int) -> Moves:
    """Replica moves from ``before`` to ``after`` over ``keys``."""
    changed = {m.node for m in before} ^ {m.node for m in after}
    moved = touched = foreign = 0
    for k in keys:
        old = set(owners(k, before, replicas))
        new = set(owners(k, after, replicas))
        gained = new - old
        if gained:
            touched += 1
            moved += len(gained)
            # a gained owner is the joiner, or replaces a replica the leaver lost
            if not (gained <= changed or (old - new) <= changed):
                foreign += len(gained)
    return Moves(len(keys), replicas, moved, touched, foreign, len(after))
