"""``PeerTable``: peers numbered by incarnation and numbered anew when the table is full
(C unrouted first, the last holder of a number kept), told to C only when their paths or
extra changed, their paths the vQP's first two UP ones on a local NIC; ``stage``: the
staging slots given to C until it takes no more. C's calls are fakes that record them."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from kspeedfs.cluster.native.peer_table import PeerTable, stage

NICS = ["10.0.0.1", "10.0.0.2"]


class FakeVQP:
    """A vQP's ``native_paths``: (soft engine, qpn, local NIC, raddr, rkey) per UP path."""

    def __init__(self, paths: list[tuple[Any, int, str, int, int]]) -> None:
        self.up = paths

    def native_paths(self, remote: str) -> list[tuple[Any, int, str, int, int]]:
        assert remote == "arena"
        return list(self.up)


class FakeC:
    """C's calls, recorded."""

    def __init__(self) -> None:
        self.engines: list[object] = []
        self.told: list[tuple[Any, ...]] = []
        self.unrouted = 0

    def engine(self, raw: object) -> int:
        self.engines.append(raw)
        return 100 + len(self.engines) - 1

    def peer(self, idx: int, paths: list[Any], *extra: Any) -> None:
        self.told.append((idx, list(paths), *extra))

    def unroute(self) -> None:
        self.unrouted += 1


def vqp(paths: list[tuple[Any, int, str, int, int]]) -> Any:
    return FakeVQP(paths)


def rec(node: str, started: float = 1.0) -> Any:
    return SimpleNamespace(node=node, started=started)


def table(size: int = 64) -> tuple[PeerTable, FakeC]:
    c = FakeC()
    return PeerTable(NICS, size, c.engine, c.peer, c.unroute), c


ENG = object()
VQP1 = vqp([(ENG, 7, NICS[1], 0x1000, 42)])


def test_paths_are_the_first_two_up_on_a_local_nic_in_lkey_order() -> None:
    t, c = table()
    other = object()
    three = vqp([(ENG, 1, "10.9.9.9", 0xA, 1), (other, 2, NICS[1], 0xB, 2),
                 (ENG, 3, NICS[0], 0xC, 3)])
    assert t.tell(rec("n1"), three) == 0
    assert c.told == [(0, [(100, 2, 0xB, 2, 1)])]     # the third path is not C's
    assert c.engines == [other]                         # a handle only for a path told
    assert t.handle(other) == 100 and t.handle(ENG) == 101 and t.handle(ENG) == 101
    assert c.engines == [other, ENG]
    assert t.qpn(0, 0) == 2 and t.qpn(0, 1) == 0 and t.qpn(5, 0) == 0


def test_told_only_when_paths_or_extra_changed() -> None:
    t, c = table()
    lasts: list[tuple[Any, ...]] = []

    def extra(last: tuple[Any, ...], up: bool) -> tuple[Any, ...]:
        lasts.append(last)
        return (5 if up else 0,)

    assert t.tell(rec("n1"), VQP1, extra=extra) == 0
    assert t.tell(rec("n1"), VQP1, extra=extra) == 0
    assert c.told == [(0, [(100, 7, 0x1000, 42, 1)], 5)]
    assert lasts == [(), (5,)]
    assert t.tell(rec("n1"), VQP1, withhold=True, extra=extra) is None   # paths off
    assert c.told[-1] == (0, [], 0)
    down = vqp([])
    assert t.tell(rec("n1"), down) is None and c.told[-1] == (0, [])
    assert t.tell(rec("n1"), down) is None and len(c.told) == 3
    assert t.record(0) == (rec("n1"), down)


def test_a_full_table_is_numbered_anew_keeping_the_last_holders() -> None:
    t, c = table()
    for i in range(64):
        assert t.tell(rec(f"n{i}"), VQP1) == i
    assert c.unrouted == 0 and len(c.told) == 64
    assert t.tell(rec("n3", started=2.0), VQP1) == 0       # a new incarnation: full
    assert c.unrouted == 1 and c.told[-1][0] == 0
    assert t.numbered() == {0: (rec("n3", started=2.0), VQP1)}
    assert t.record(5) == (rec("n5"), VQP1)                 # a READ out under number 5
    assert t.qpn(5, 0) == 0                                 # (its paths: forgotten)
    assert t.number_of("n5", 1.0) is None and t.number_of("n3", 2.0) == 0
    assert t.tell(rec("n1"), VQP1) == 1                      # told again: a new number
    assert c.told[-1][0] == 1 and c.unrouted == 1


def test_staging_slots_are_given_until_c_takes_no_more() -> None:
    given: list[tuple[int, int, list[int]]] = []

    allocs: list[tuple[int, str]] = []

    class VMR:
        def on(self, nic: str, at: int) -> tuple[int, int]:
            return 0x10000 + at, NICS.index(nic) + 1

    class Endpoint:
        def alloc(self, n: int, name: str) -> VMR:
            allocs.append((n, name))
            return VMR()

    def give(laddr: int, size: int, lkeys: list[int]) -> bool:
        given.append((laddr, size, lkeys))
        return len(given) < 2

    ep: Any = Endpoint()
    vmr = stage(ep, 3, 5000, NICS, give, "c-staging")
    assert isinstance(vmr, VMR) and allocs == [(3 * 8192, "c-staging")]
    assert given == [(0x10000, 5000, [1, 2]), (0x10000 + 8192, 5000, [1, 2])]
