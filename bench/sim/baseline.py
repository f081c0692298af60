"""The yardsticks: a plain put loop and a plain listing loop against the same etcd.

    python -m bench.sim.baseline '<config JSON>'    prints {"ops": n, "seconds": s}

``puts``: ``threads`` threads, each putting ``value_bytes`` values under its own keys
through one EtcdStore (``call``: one endpoint, the member the thread was given), as
fast as etcd answers, for ``seconds``. ``lists``: the same threads listing
``P nodes/`` (a range of every node record). The bench runs two such processes at
once and reads etcd's CPU meanwhile: on this 2-core machine the Python clients take
CPU from etcd, so the rate is a lower bound of what the 3 members sustain.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time

from kspeedfs.config import StoreConfig
from kspeedfs.manifest.store.etcd import EtcdStore


def main() -> None:
    cfg = json.loads(sys.argv[1])
    stores = [EtcdStore(StoreConfig(backend="etcd", etcd=[ep], etcd_prefix=cfg["prefix"]))
              for ep in cfg["endpoints"]]
    value = os.urandom(cfg["value_bytes"] // 2).hex().encode()
    count = [0] * cfg["threads"]
    stop = time.monotonic() + cfg["seconds"]
    listing = cfg["prefix"] + "nodes/"

    def put(i: int) -> None:
        store = stores[i % len(stores)]
        key = f"{cfg['prefix']}baseline/{os.getpid()}-{i}"
        while time.monotonic() < stop:
            if cfg["op"] == "puts":
                store.call(lambda c: c.put(key, value))
            else:
                store.call(lambda c: c.get_prefix_response(listing))
            count[i] += 1
    threads = [threading.Thread(target=put, args=(i,)) for i in range(cfg["threads"])]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"ops": sum(count), "seconds": time.monotonic() - t0}), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
