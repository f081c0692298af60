"""A registration grants one lease, however its first put and its keep-alive task meet.

``daemon._hold`` starts ``Registration.run`` and then puts the mount's record; both
found no lease and both granted one. The second lease was never refreshed and lapsed
(the cluster simulator saw 8 of 20 mounts grant two), and a record put on it would
vanish with it for up to a hold period."""
from __future__ import annotations

import os
import urllib.request
import uuid
from typing import Any

import trio

from kspeedfs.cluster.membership import Registration
from kspeedfs.config import StoreConfig
from kspeedfs.manifest.store.etcd import EtcdStore
from tests.fixtures.etcd import EtcdServer


def _granted(server: EtcdServer) -> int:
    with urllib.request.urlopen(f"{server.endpoint}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("etcd_debugging_lease_granted_total "):
                return int(float(line.split()[1]))
    raise AssertionError("etcd has no lease counter")


def _lease_of(store: EtcdStore, key: str) -> int:
    resp: Any = store.call(lambda c: c.get_response(key))
    return int(resp.kvs[0].lease)


async def test_a_first_put_racing_the_keep_alive_grants_one_lease(
        etcd_server_private: EtcdServer) -> None:
    cfg = StoreConfig(backend="etcd", etcd=[etcd_server_private.endpoint],
                      etcd_prefix=f"/ksf-{uuid.uuid4().hex[:12]}/")
    store = EtcdStore(cfg, os.urandom(32))
    try:
        before = _granted(etcd_server_private)
        regs = [Registration(store, 5) for _ in range(20)]
        async with trio.open_nursery() as n:
            for i, reg in enumerate(regs):           # as daemon._hold: run, then put
                n.start_soon(reg.run)
                n.start_soon(trio.to_thread.run_sync, reg.put, f"{cfg.etcd_prefix}k{i}", b"v")
            await trio.sleep(1.0)
            assert _granted(etcd_server_private) - before == 20
            for i, reg in enumerate(regs):            # each key is on the refreshed lease
                assert await trio.to_thread.run_sync(_lease_of, store, f"{cfg.etcd_prefix}k{i}") \
                    == reg.lease_id
            n.cancel_scope.cancel()
    finally:
        store.close()
