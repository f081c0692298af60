"""A preload's plan counts every live node's SSD tier from its signed node record.

The SSD capacity used to be read from ``stats/<node>``, which each node rewrites every
2 s only for ``kspeedfs status``: the record carries it now (``NodeRecord.disk_capacity``),
so the plan no longer depends on that record, which is to leave etcd (docs/design.md,
"1,000 nodes, simulated"). A record of an earlier node version has none; its ``stats/``
record is read for it."""
from __future__ import annotations

import json
import os
import uuid

from kspeedfs.cluster.lifecycle import cluster_plan
from kspeedfs.cluster.membership import NodeRecord
from kspeedfs.config import StoreConfig
from kspeedfs.manifest.store.etcd import EtcdStore
from tests.fixtures.etcd import EtcdServer

SLOT = 4 << 20


def _record(name: str, disk: int | None) -> NodeRecord:
    return NodeRecord(name, "h", ["10.9.0.1"], 7470, 7471, 1 << 30, 256, SLOT, 512,
                      disk_capacity=disk)


def test_the_plan_counts_ssd_tiers_from_node_records(etcd_server: EtcdServer) -> None:
    cfg = StoreConfig(backend="etcd", etcd=[etcd_server.endpoint],
                      etcd_prefix=f"/ksf-{uuid.uuid4().hex[:12]}/")
    with EtcdStore(cfg, os.urandom(32)) as store:
        def put(key: str, value: bytes) -> None:
            store.call(lambda c: c.put(store.prefix + key, value))

        for name, disk, stats_disk in (("new", 100 * SLOT, None),          # the record's
                                       ("earlier", None, 30 * SLOT),       # stats/ for it
                                       ("none", 0, 70 * SLOT)):            # record wins
            put(f"nodes/{name}", _record(name, disk).signed(store))
            if stats_disk is not None:
                put(f"stats/{name}", json.dumps({"disk": {"capacity": stats_disk}}).encode())
        plan = cluster_plan(store, "ds", 1, 10, 0, 2)
    assert plan.memory_slots == 3 * 256
    assert plan.disk_slots == 130
