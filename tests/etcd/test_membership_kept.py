"""A mount's last known node list (cluster/membership.py ``PrefixView.keep``/``seed``).

The daemon serving a mount keeps the node records it last saw in a file; the daemon that
takes the mount over (a resume after a crash, an upgrade) starts from them when etcd does
not list the nodes in time, so its reads go to the peers and not to the source during an
outage. The kept records pass the same checks as etcd's: a record added to the file
without the cluster secret is refused."""
from __future__ import annotations

import base64
import json
import logging
import random
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from kspeedfs.cluster.membership import Membership, NodeRecord, PrefixView
from kspeedfs.config import StoreConfig
from kspeedfs.manifest.store.etcd import EtcdStore
from tests.fixtures.etcd import EtcdServer

SECRET = b"kept-members-test-cluster-secret"


def _record(name: str) -> NodeRecord:
    return NodeRecord(name, "h", ["10.9.0.1"], 7470, 7471, 1 << 30, 256, 4 << 20, 512)


@pytest.fixture
def store(etcd_server: EtcdServer) -> Iterator[EtcdStore]:
    cfg = StoreConfig(backend="etcd", etcd=[etcd_server.endpoint],
                      etcd_prefix=f"/ksf-{uuid.uuid4().hex[:12]}/", etcd_timeout=5.0)
    with EtcdStore(cfg, SECRET) as s:
        yield s  # type: ignore[misc]


def _down(prefix: str) -> EtcdStore:
    """A store of the same cluster whose etcd does not answer (a closed loopback port)."""
    return EtcdStore(StoreConfig(backend="etcd", etcd=["http://127.0.0.1:9"], etcd_prefix=prefix,
                                 etcd_timeout=1.0), SECRET)


async def _nodes(membership: Membership) -> set[str]:
    async with trio.open_nursery() as nursery:
        await nursery.start(membership.run)
        nodes = set(membership.nodes)
        nursery.cancel_scope.cancel()
    return nodes


async def test_a_daemon_taking_over_starts_from_the_kept_node_list_while_etcd_is_down(
        store: EtcdStore, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    kept = str(tmp_path / "run" / "mnt.members")
    for name in ("n1", "n2"):
        key = store.prefix + "nodes/" + name
        value = _record(name).signed(store)
        await trio.to_thread.run_sync(lambda key=key, value=value: store.call(lambda c: c.put(key, value)))
    assert await _nodes(Membership(store, keep=kept)) == {"n1", "n2"}

    # somebody adds a record of their own to the file: not signed, refused on the way in
    doc = json.loads(Path(kept).read_bytes())
    doc["evil"] = base64.b64encode(_record("evil").to_json()).decode()
    Path(kept).write_text(json.dumps(doc))

    with _down(store.prefix) as down, caplog.at_level(logging.INFO):
        assert await _nodes(Membership(down, first_wait=0.3, keep=kept, seed=True)) == {"n1", "n2"}
        assert "the last daemon knew" in caplog.text
        assert await _nodes(Membership(down, first_wait=0.3, keep=kept)) == set()   # a fresh mount
        Path(kept).write_bytes(b'{"n1": "not base64!"}')
        assert await _nodes(Membership(down, first_wait=0.3, keep=kept, seed=True)) == set()
        assert "ignoring the last known" in caplog.text


def test_a_kept_file_is_values_or_a_value_error(tmp_path: Path) -> None:
    """The parser of the kept file, fuzzed: random and mutated files give the values or
    ValueError, nothing else."""
    rng = random.Random(11)
    good = json.dumps({f"n{i}": base64.b64encode(rng.randbytes(40)).decode()
                       for i in range(3)}).encode()
    path = tmp_path / "kept"
    path.write_bytes(good)
    assert set(PrefixView.last_known(str(path))) == {"n0", "n1", "n2"}
    for case in range(600):
        if case % 3 == 0:
            raw = rng.randbytes(rng.randrange(0, 64))
        else:
            raw = bytearray(good)
            for _ in range(rng.randrange(1, 4)):
                raw[rng.randrange(len(raw))] = rng.randrange(256)
            raw = bytes(raw)
        path.write_bytes(raw)
        try:
            values = PrefixView.last_known(str(path))
        except ValueError:
            continue
        assert all(isinstance(k, str) and isinstance(v, bytes) for k, v in values.items())
