"""Job-start storm: many mounts of one large dataset start at once against a real etcd.

    python -m bench.manifest_storm --files 10000000 --agents 1 50 200 [--whole 4]

A synthetic dataset (``bench.manifest_scale.SyntheticSource``) is imported once into a
real single-member etcd (data in /dev/shm) with its manifest pages in a page directory
(``store.pages``, /dev/shm here: what a shared filesystem or a node's copy serves). Then,
per count K in ``--agents``, K agent processes start, import kspeedfs, and wait at a
barrier; released together, each does what a mount does before it is live
(``daemon.load_dataset``: the info record and the manifest's root from etcd, the table
pages, the page map) and then a ``stat`` of one random file by path (lookups down the
tree: the pages a first request touches). Printed per K: the time from release to the
last agent live, against one agent alone in the same run; etcd's bytes sent and CPU per
agent (its ``/metrics`` and ``/proc``); each agent's CPU and RSS growth.

``--whole N`` runs N agents of the same dataset imported whole into etcd (the
manifest before pages): the baseline of what each mount took from etcd.

``--copy`` adds, after the store.pages runs, a node's page copy
(``cluster/page_copy.py``): a "holder" node answers ``page`` RPCs from store.pages on
127.0.0.1, a second node with no store.pages fills its copy from it (printed: pages,
bytes, time), and the same agent counts run again with the copy as their only page
directory. Printed per run: ``store_pages_bytes_per_agent``, the page files' bytes the
agents read from store.pages (table pages and page-map fills x the mean page file:
0 with the copy), and, for the copy, the nodes' reads of store.pages (each page once).

Agents are processes on this one 2-core machine, so K agents share two cores: the
release-to-live time grows with K × an agent's CPU, which separate hosts would not
share; etcd's bytes and CPU per agent are what carry over (docs/design.md, "Paged
manifests").
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import time
import urllib.request
from typing import Any

from tests.fixtures.etcd import EtcdServer
from tests.fixtures.etcd_cluster import proc_cpu_seconds

SECRET = b"manifest-storm-secret-0123456789abcdef"
PY = sys.executable
BASE = "/dev/shm/kspeedfs-storm"


def _config(endpoint: str, pages: str, paged: bool) -> Any:
    from kspeedfs.config import Config

    cfg = Config()
    cfg.store.backend = "etcd"
    cfg.store.etcd = [endpoint]
    cfg.store.pages = pages if paged else ""
    cfg.store.paged_above = 1 << 20 if paged else 1 << 40
    cfg.cluster.secret_file = os.path.join(BASE, "secret")
    return cfg


def _etcd_sent(endpoint: str) -> float:
    with urllib.request.urlopen(f"{endpoint}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("etcd_network_client_grpc_sent_bytes_total"))


def agent(endpoint: str, pages: str, paged: bool, name: str) -> None:
    """One mount's manifest steps after the barrier (a line on stdin); prints JSON."""
    from kspeedfs import compose
    from kspeedfs.manifest.load import open_index
    from kspeedfs.manifest.pages import Root
    from kspeedfs.manifest.store import etcd  # noqa: F401  (a daemon has it loaded by then)

    cfg = _config(endpoint, pages, paged)
    rss0 = _rss()
    print("ready", flush=True)
    sys.stdin.readline()
    t0, c0 = time.perf_counter(), time.process_time()
    info, blob = compose.fetch_manifest(cfg, name, None)
    index = open_index(blob, info, pages if paged else None, cfg.store.page_cache)
    d = random.randrange(index.size[0])
    entry = index.lookup(0, index.name(index.data[0] + d))
    assert entry is not None
    leaf = index.data[entry] + random.randrange(max(1, index.size[entry]))
    found = index.lookup(entry, index.name(leaf))
    assert found == leaf and index.size[leaf] >= 0
    live = time.perf_counter() - t0
    fills = 0
    if index.pages is not None:                   # data pages the map filled + the tables
        fills = index.pages.stats()["fills"] + len(Root.parse(blob).tables)
    print(json.dumps({"live": live, "cpu": time.process_time() - c0, "rss": _rss() - rss0,
                      "blob": len(blob), "fills": fills}), flush=True)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _mean_file(pages: str) -> tuple[float, int]:
    """The mean size of the page files under ``pages``, and how many there are."""
    sizes = [e.stat().st_size for d in os.scandir(pages) if d.is_dir()
             for e in os.scandir(d.path) if not e.name.endswith(".tmp")]
    return sum(sizes) / max(1, len(sizes)), len(sizes)


def fill_copy(endpoint: str, pages: str, copy: str, name: str) -> dict[str, Any]:
    """A holder node serving store.pages over the node RPC on 127.0.0.1, and a node with
    no store.pages filling ``copy`` from it (``PageCopy.fill``)."""
    import trio

    from kspeedfs.cluster import rpc
    from kspeedfs.cluster.connections import Connections
    from kspeedfs.cluster.membership import NodeRecord
    from kspeedfs.cluster.node_stats import NodeCounters
    from kspeedfs.cluster.page_copy import PageCopy
    from kspeedfs.cluster.placement import Member
    from kspeedfs.manifest.store import open_store

    class Members:                              # the one live peer: the holder
        def __init__(self, rec: NodeRecord) -> None:
            self.members, self.nodes = [Member(rec.node)], {rec.node: rec}

    async def run(store: Any) -> dict[str, Any]:
        holder = PageCopy(os.path.join(BASE, "holder-copy"), pages, "holder", store, None,  # type: ignore[arg-type]
                          None, NodeCounters(), 1)  # type: ignore[arg-type]

        async def handle(req: dict[str, Any]) -> dict[str, Any]:
            return await holder.answer(req.get("hash"))

        async with trio.open_nursery() as n:
            ls = await n.start(lambda task_status: rpc.serve(
                SECRET, "holder", handle, 0, "127.0.0.1", task_status=task_status))
            rec = NodeRecord(node="holder", host="h", nics=["127.0.0.1"], port=1,
                             rpc_port=ls[0].socket.getsockname()[1], capacity=1, nslots=1,
                             slot_size=1, nbuckets=1)
            conns = Connections(None, SECRET, "filler", 5.0, n)  # type: ignore[arg-type]
            filler = PageCopy(copy, None, "filler", store, Members(rec), conns,  # type: ignore[arg-type]
                              NodeCounters(), 4)
            version = store.dataset(name, None).version
            t0 = time.perf_counter()
            await filler.fill(name, version)
            took = time.perf_counter() - t0
            await conns.aclose()
            n.cancel_scope.cancel()
        mean, count = _mean_file(copy)
        return {"copy_pages": count, "copy_bytes": int(mean * count), "fill_s": took,
                "from_peers": filler.counters.pages_from_peers,
                "store_pages_read_by_nodes": holder.counters.pages_served}

    with open_store(_config(endpoint, pages, True).store, SECRET) as store:
        return trio.run(run, store)


def storm(endpoint: str, pages: str, paged: bool, name: str, k: int, etcd_pid: int) -> dict[str, Any]:
    procs = [subprocess.Popen([PY, "-m", "bench.manifest_storm", "--agent", endpoint, pages,
                               "1" if paged else "0", name],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for _ in range(k)]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    sent0, cpu0 = _etcd_sent(endpoint), proc_cpu_seconds(etcd_pid)
    t0 = time.perf_counter()
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    results = []
    for p in procs:
        assert p.stdout is not None
        results.append(json.loads(p.stdout.readline()))
        p.wait()
    wall = time.perf_counter() - t0
    sent, cpu = _etcd_sent(endpoint) - sent0, proc_cpu_seconds(etcd_pid) - cpu0
    lives = sorted(r["live"] for r in results)
    return {"agents": k, "paged": paged, "all_live_s": wall, "median_live_s": lives[k // 2],
            "etcd_bytes_per_agent": sent / k, "etcd_cpu_ms_per_agent": 1000 * cpu / k,
            "agent_cpu_ms": 1000 * sum(r["cpu"] for r in results) / k,
            "agent_rss_mb": sum(r["rss"] for r in results) / k / 1e6,
            "root_bytes": results[0]["blob"], "page_fills_per_agent": sum(r["fills"] for r in results) / k}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=10_000_000)
    ap.add_argument("--agents", type=int, nargs="+", default=[1, 50, 200])
    ap.add_argument("--whole", type=int, default=0, help="agents of the whole manifest")
    ap.add_argument("--copy", action="store_true",
                    help="also run the agents on a node's page copy filled from a peer")
    ap.add_argument("--agent", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.agent:
        endpoint, pages, paged, name = args.agent
        agent(endpoint, pages, paged == "1", name)
        return

    from bench.manifest_scale import SyntheticSource
    from kspeedfs.manifest.importer import import_tree
    from kspeedfs.manifest.store import open_store

    shutil.rmtree(BASE, ignore_errors=True)
    os.makedirs(BASE)
    with open(os.path.join(BASE, "secret"), "wb") as f:
        f.write(SECRET)
    os.chmod(os.path.join(BASE, "secret"), 0o600)
    pages = os.path.join(BASE, "pages")
    etcd = EtcdServer(data_dir=os.path.join(BASE, "etcd"),
                      extra_args=["--quota-backend-bytes", str(8 << 30)]).start()
    try:
        kinds = [(True, "paged")] + ([(False, "whole")] if args.whole else [])
        for paged, name in kinds:
            cfg = _config(etcd.endpoint, pages, paged)
            t0 = time.perf_counter()
            with open_store(cfg.store, SECRET) as store:
                info = import_tree(SyntheticSource(args.files), name, store, 4 << 20)
            print(f"imported {name}: {info.entries} entries in {time.perf_counter() - t0:.1f} s, "
                  f"{info.manifest_size} bytes in etcd, {info.inflated_size} inflated", flush=True)
        runs = [(True, "paged", k) for k in args.agents]
        runs += [(False, "whole", k) for k in ([1, args.whole] if args.whole else [])]
        mean, _ = _mean_file(pages)
        for paged, name, k in runs:
            r = storm(etcd.endpoint, pages, paged, name, k, etcd.pid or 0)
            if paged:
                r["store_pages_bytes_per_agent"] = int(r["page_fills_per_agent"] * mean)
            print(json.dumps(r), flush=True)
        if args.copy:
            copy = os.path.join(BASE, "copy")
            filled = fill_copy(etcd.endpoint, pages, copy, "paged")
            print(json.dumps(filled), flush=True)
            for k in args.agents:
                r = storm(etcd.endpoint, copy, True, "paged", k, etcd.pid or 0)
                r.update(copy=True, store_pages_bytes_per_agent=0,
                         store_pages_pages_read_by_nodes=filled["store_pages_read_by_nodes"])
                print(json.dumps(r), flush=True)
    finally:
        etcd.stop()
        shutil.rmtree(BASE, ignore_errors=True)


if __name__ == "__main__":
    main()
