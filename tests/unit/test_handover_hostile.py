"""The handover socket's messages from a broken or hostile asker (fuse/upgrade.py). The
socket is local and root-only, but what arrives on it is parsed like any wire input: an
object or one ``MountError``, and a serving daemon answers every ask but the right one
with a refusal and goes on serving (``HandoverServer._serve_one`` over a real socket);
a ``stats`` ask gets the counters, and a pyfuse3 mount refuses every handover."""
from __future__ import annotations

import json
import socket

import trio
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kspeedfs.errors import MountError
from kspeedfs.fuse import upgrade
from tests.fixtures.hostile import deep, json_values, run


@settings(deadline=None)
@given(st.one_of(st.binary(max_size=256), json_values.map(lambda v: json.dumps(v).encode()),
                 st.integers(0, 5000).map(deep)))
def test_a_handover_message_is_an_object_or_one_mount_error(data: bytes) -> None:
    try:
        msg = upgrade._message(data)
    except MountError:
        return
    assert isinstance(msg, dict)


#: asks with each field missing, right, or any JSON value
asks = st.fixed_dictionaries({}, optional={
    "format": st.just(upgrade.FORMAT) | json_values, "dataset": st.just("ds") | json_values,
    "version": st.just(1) | json_values, "mountpoint": st.just("/mnt/x") | json_values,
    "extra": json_values})


@settings(max_examples=60, deadline=None)
@given(asks)
def test_every_ask_but_the_right_one_is_refused_and_nothing_stops(ask: dict) -> None:
    assume(not (ask.get("format") == upgrade.FORMAT
                and (ask.get("dataset"), ask.get("version")) == ("ds", 1)
                and ask.get("mountpoint", "/mnt/x") == "/mnt/x"))
    stopped: list[bool] = []

    async def stop() -> None:
        stopped.append(True)

    server = upgrade.HandoverServer("/mnt/x", "ds", 1, -1, lambda: {"transport": "/dev/fuse"},
                                    stop)
    reply = _ask(server, ask)
    assert isinstance(reply.get("error"), str) and reply["error"]
    assert stopped == [] and not server.handed_over.is_set()


def _ask(server: upgrade.HandoverServer, ask: dict) -> dict:
    """``server``'s reply to ``ask``, over a real socket pair (no fds come with it)."""
    async def one() -> dict:
        a, b = trio.socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with a, b:
            await a.send(json.dumps(ask).encode())
            await server._serve_one(b)
            reply, fds = await upgrade._recv(a, 5.0)
        assert fds == []
        return reply

    return run(one)


def test_the_control_socket_answers_stats_and_a_pyfuse3_mount_hands_nothing_over() -> None:
    async def stop() -> None:
        raise AssertionError("a pyfuse3 mount is never stopped by a handover")

    server = upgrade.HandoverServer("/mnt/x", "ds", 1, -1, lambda: {"transport": "pyfuse3"},
                                    stop, stats=lambda: {"reads": 7})
    assert _ask(server, {"format": upgrade.FORMAT, "stats": True}) == \
        {"format": upgrade.FORMAT, "stats": {"reads": 7}}
    reply = _ask(server, {"format": upgrade.FORMAT, "dataset": "ds", "version": 1,
                          "mountpoint": "/mnt/x"})
    assert "pyfuse3 engine" in reply["error"] and not server.handed_over.is_set()
    bare = upgrade.HandoverServer("/mnt/x", "ds", 1, -1, dict, stop)
    assert "no counters" in _ask(bare, {"format": upgrade.FORMAT, "stats": True})["error"]
