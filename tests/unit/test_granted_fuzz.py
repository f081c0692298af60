"""The library's parsing of a grant server's replies (``cluster/granted.py``), fuzzed.

A real ``SOCK_SEQPACKET`` socket pair stands in for the node's grant socket: its far
end answers each request with the next generated datagram (arbitrary bytes, arbitrary
JSON, or a reply object with fields of the wrong type, size or sign), some with memfd
segments attached by ``SCM_RIGHTS``. Whatever comes, the grant request raises only
GrantLost or GrantRefused (with an int errno), a read returns None or the verified
bytes, never raises, and every fd that came with a reply is closed.
"""
from __future__ import annotations

import array
import json
import os
import socket
from typing import Any

import trio
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kspeedfs.cluster.granted import GrantedArena
from kspeedfs.errors import GrantLost, GrantRefused

SLOT = 4096
BLOB = bytes(range(256)) * 8                  # 2 KiB held in slot 1 of segment 0
KEY = xxhash.xxh3_128_digest(BLOB)
FUZZ = settings(max_examples=300, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])


class Keys:
    """A one-chunk manifest as ``GrantedArena`` asks it."""

    chunks = 1

    def chunk_digest(self, k: int) -> bytes:
        return KEY


def _segment() -> int:
    fd = os.memfd_create("granted-fuzz")
    os.ftruncate(fd, 2 * SLOT)
    os.pwrite(fd, BLOB, SLOT)
    return fd


ints = st.one_of(st.integers(-3, 3), st.integers(-(1 << 70), 1 << 70), st.booleans(),
                 st.sampled_from([SLOT, 2 * SLOT, 3 * SLOT]))
values = st.one_of(ints, st.none(), st.floats(allow_nan=False), st.text(max_size=4))
slot_answers = st.one_of(st.just([1, len(BLOB)]), st.just([0, len(BLOB)]),
                         st.lists(values, max_size=3), values)
objects = st.fixed_dictionaries(
    {"ok": st.sampled_from([True, True, True, False, 1, "true", None])},
    optional={"slot_size": st.one_of(st.just(SLOT), values),
              "segment_bytes": st.one_of(st.just(2 * SLOT), values),
              "segments": st.one_of(st.just([0]), st.lists(values, max_size=3), values),
              "slots": st.one_of(st.lists(slot_answers, max_size=3), values),
              "errno": st.one_of(st.sampled_from(["EACCES", "EINVAL", "__doc__", "__name__",
                                                  "errorcode", "__spec__", ""]), values),
              "message": st.one_of(st.text(max_size=300), values, st.lists(values, max_size=3))})
datagrams = st.one_of(st.binary(max_size=64),
                      st.recursive(values, lambda c: st.lists(c, max_size=3)
                                   | st.dictionaries(st.text(max_size=3), c, max_size=3))
                      .map(lambda v: json.dumps(v).encode()),
                      objects.map(lambda d: json.dumps(d).encode()))
GRANT = json.dumps({"ok": True, "slot_size": SLOT, "segment_bytes": 2 * SLOT,
                    "segments": [0]}).encode()
LOCATE = json.dumps({"ok": True, "slots": [[1, len(BLOB)]], "segments": []}).encode()
# a well-formed grant or locate often enough that the reads behind them are reached
replies = st.tuples(st.one_of(st.just((GRANT, 1)), st.tuples(datagrams, st.integers(0, 2))),
                    st.lists(st.one_of(st.just((LOCATE, 0)), st.tuples(datagrams, st.integers(0, 2))),
                             max_size=3)).map(lambda t: [t[0], *t[1]])


async def _serve(sock: trio.socket.SocketType, script: list[tuple[bytes, int]]) -> None:
    """Each request answered with the script's next datagram and that many memfds."""
    with sock:
        for raw, nfds in script:
            if not await sock.recv(1 << 16):
                return
            fds = [_segment() for _ in range(nfds)]
            try:
                ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                await sock.sendmsg([raw], ancillary if fds else [])
            finally:
                for fd in fds:
                    os.close(fd)


async def _session(script: list[tuple[bytes, int]]) -> list[Any]:
    ours, theirs = trio.socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    g = GrantedArena(ours, "n1", "/nonexistent.grant", "imgs", Keys(), lambda: True)  # type: ignore[arg-type]
    seen: list[Any] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_serve, theirs, script)
        try:
            await g.ask_grant()
        except (GrantLost, GrantRefused) as e:
            assert isinstance(e.errno, int) and "\n" not in str(e)
            seen.append(type(e))
            g.close()
        else:
            assert g.slot_size > 0 and g.per_segment > 0
            for _ in range(2):
                data = await g.read(0, KEY, len(BLOB))
                assert data is None or bytes(data) == BLOB
                seen.append(data is not None)
            g.close()
        nursery.cancel_scope.cancel()
    return seen


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@FUZZ
@given(script=replies)
def test_fuzz_replies_give_verified_bytes_none_or_a_grant_error(script) -> None:
    before = _open_fds()
    trio.run(_session, script)
    assert _open_fds() <= before                       # every fd a reply brought is closed


def test_a_well_formed_exchange_reads_the_chunk() -> None:
    """The fuzz's own positive case: a grant of one segment, one locate, the chunk."""
    assert trio.run(_session, [(GRANT, 1), (LOCATE, 0)]) == [True, True]


def test_an_error_reply_naming_no_errno_is_eio() -> None:
    """A refusal whose ``errno`` names an attribute of the errno module that is not an
    errno (``__doc__``) is still a refusal with an int errno."""
    raw = json.dumps({"ok": False, "errno": "__doc__", "message": "no\nsuch"}).encode()
    assert trio.run(_session, [(raw, 0)]) == [GrantRefused]
