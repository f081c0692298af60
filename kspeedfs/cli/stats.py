"""``kspeedfs stats [MOUNTPOINT | --cluster]``: a live view, like ``juicefs stats`` or ``top``.

Where the numbers come from (this command keeps no counters of its own):

    MOUNTPOINT   the mount's counters (``fuse/operations.py`` ``stats_record``:
                 ReadStatistics + PeerStatistics + per-op counts), read every
                 ``--interval`` s over the daemon's control socket (root-only:
                 ``fuse/registry.py`` ``ask``), or, where that cannot be reached (not
                 root), as the ``user.kspeedfs.stats`` xattr of a ``fuse.xattrs=true`` mount
    --cluster    every live node's ``stats`` RPC answer, asked at each sample
                 (``cluster/node_stats.py`` NodeStatistics: arena, counters, reads, endpoint)

A sample is the difference of two readings over the time between them, so the first
one comes one interval after the start. A counter that went backwards (the mount's
daemon was replaced, a node restarted) counts as 0 for that interval. A node record
that has not changed since the last sample keeps its last rates (nodes publish every
2 s, the default interval is 1 s).

Output (``cli/terminal.py``): on a terminal the view is redrawn in place; elsewhere a
mount sample is one line under a header printed once, as vmstat does, and a cluster
sample a few lines (a table of the nodes, then any path that is not UP); ``--json``
prints one JSON object per sample, one per line. Ctrl-C ends it quietly.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from ..errors import MountError
from .options import cli_logging, cluster_store, load_config, seconds
from .terminal import LiveView, Table, group

STATS_XATTR = "user.kspeedfs.stats"
TIERS = ("memory", "disk", "peer", "source")
# tier → (its chunk-request counter, its byte counter) in the stats xattr
TIER_COUNTERS = {"memory": ("memory_hits", None), "disk": ("disk_hits", "disk_hit_bytes"),
                 "peer": ("peer_hits", "peer_bytes"), "source": ("source_loads", "source_bytes")}
MIN_INTERVAL = 0.1
PATH_UP, VQP_UP = "UP", "reachable"      # rdma/vrdma path.PathState, vqp.py VQP statistics


def _interval(text: str) -> float:
    s = seconds(text)
    if s < MIN_INTERVAL:
        raise argparse.ArgumentTypeError(f"invalid interval {text!r}: at least {MIN_INTERVAL} s")
    return s


def _count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if not 0 <= n < 1 << 31:
        raise argparse.ArgumentTypeError(f"invalid count {text!r}: a number >= 0 (0: until Ctrl-C)")
    return n


def add_arguments(p: argparse.ArgumentParser) -> None:
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("mountpoint", nargs="?",
                      help="a kspeedfs mount (as root; else one mounted with fuse.xattrs)")
    what.add_argument("--cluster", action="store_true",
                      help="every live node: load rates, cache use, peer paths (from etcd)")
    p.add_argument("--interval", type=_interval, default=1.0, metavar="S",
                   help="seconds between samples (default 1)")
    p.add_argument("--count", type=_count, default=0, metavar="N",
                   help="stop after N samples (default 0: until Ctrl-C)")
    p.add_argument("--json", action="store_true", help="one JSON object per sample, one per line")


def run(args: argparse.Namespace) -> int:
    cli_logging(args)
    if args.cluster:
        cfg = load_config(args)
        store = cluster_store(cfg, "stats --cluster")
        try:
            return _watch(ClusterReader(store, cfg.cluster.secret()), ClusterRates(),
                          _cluster_view, args)
        finally:
            store.close()
    load_config(args)                   # a bad --set or --config is an error here too
    return _watch(MountReader(args.mountpoint), MountRates(), _mount_view, args)


class Rates(Protocol):
    """Turns successive readings into samples: :class:`MountRates`, :class:`ClusterRates`."""

    def start(self, reading: dict[str, Any]) -> None: ...
    def update(self, reading: dict[str, Any]) -> dict[str, Any]: ...


View = Callable[[dict[str, Any], str, float, bool], tuple[Any, list[str]]]


def _watch(reader: Callable[[], dict[str, Any]], rates: Rates, view: View,
           args: argparse.Namespace) -> int:
    """Read, sleep, read, show the rates; ``args.count`` samples (0: until Ctrl-C)."""
    title = getattr(reader, "title", "")
    try:
        rates.start(reader())
        t_next = time.monotonic()
        with contextlib.ExitStack() as stack:
            live = None if args.json else stack.enter_context(LiveView())
            for n in _samples(args.count):
                t_next = max(t_next + args.interval, time.monotonic())   # never catch up
                time.sleep(max(0.0, t_next - time.monotonic()))
                sample = rates.update(reader())
                if live is None:
                    print(json.dumps(sample), flush=True)
                else:
                    live.show(*view(sample, title, args.interval, n == 0))
    except KeyboardInterrupt:             # how a watch ends: quietly
        pass
    except BrokenPipeError:               # `kspeedfs stats MNT | head`: the reader has gone
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # no error at exit
    return 0


def _samples(count: int) -> Iterator[int]:
    n = 0
    while not count or n < count:
        yield n
        n += 1


def _per_s(cur: dict[str, Any], prev: dict[str, Any], key: str | None, dt: float) -> float | None:
    if key is None or key not in cur:
        return None
    return max(0, cur[key] - prev.get(key, 0)) / dt if dt > 0 else 0.0


def _r(x: float | None, digits: int = 1) -> float | None:
    return None if x is None else round(x, digits)


# -- a mount -----------------------------------------------------------------------------

class MountReader:
    """The counters of the kspeedfs mount at ``path``, one reading per call: over its
    daemon's control socket, else (that socket is root-only) as its ``stats`` xattr.
    Refuses, with a one-line :class:`MountError`, a path that is not a kspeedfs
    mountpoint, a mount neither way reaches and a mount whose daemon is gone."""

    def __init__(self, path: str) -> None:
        from .. import mountpoint

        if not path:
            raise MountError("an empty mountpoint")
        self.path = os.path.realpath(path)
        if not os.path.isdir(self.path):
            raise MountError(f"{path}: no such directory")
        fstype = mountpoint.mounts().get(self.path)
        if fstype != "fuse.kspeedfs":
            raise MountError(f"{path} is not a kspeedfs mount"
                             + (f" (it is a {fstype} mount)" if fstype else ""))
        self.socket_why = ""              # why the control socket did not answer
        served = self._ask({"query": True})
        dataset = (f"{served['dataset']}@{served['version']}" if served
                   else self._xattr("user.kspeedfs.dataset").decode(errors="replace"))
        self.title = f"{dataset} at {self.path}"

    def __call__(self) -> dict[str, Any]:
        reply = self._ask({"stats": True})
        stats = reply.get("stats") if reply else None
        record = stats if isinstance(stats, dict) else json.loads(self._xattr(STATS_XATTR))
        record["time"] = time.time()
        return record

    def _ask(self, request: dict[str, Any]) -> dict[str, Any] | None:
        """The control socket's reply; None (and why, for the error) when it gives none."""
        from ..fuse import registry

        try:
            return registry.ask(self.path, request)
        except MountError as e:
            self.socket_why = str(e)
            return None

    def _xattr(self, name: str) -> bytes:
        try:
            return os.getxattr(self.path, name)
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.ENODATA):
                raise MountError(f"{self.path}: its counters cannot be read: {self.socket_why}, "
                                 "and it was mounted without fuse.xattrs (run as root, or "
                                 "remount it with --set fuse.xattrs=true)") from e
            if e.errno == errno.ENOTCONN:
                raise MountError(f"{self.path}: its daemon is gone (transport endpoint is not "
                                 "connected); `kspeedfs umount` it") from e
            raise MountError(f"{self.path}: cannot read {name}: {e.strerror}") from e


class MountRates:
    """Turns successive stats records of one mount into samples (plain dicts, the
    ``--json`` objects)."""

    def __init__(self) -> None:
        self.prev: dict[str, Any] = {}
        self.t = 0.0

    def start(self, record: dict[str, Any]) -> None:
        self.prev, self.t = record, time.monotonic()

    def update(self, record: dict[str, Any]) -> dict[str, Any]:
        now = time.monotonic()
        sample = mount_sample(self.prev, record, now - self.t)
        self.prev, self.t = record, now
        return sample


def mount_sample(prev: dict[str, Any], cur: dict[str, Any], dt: float) -> dict[str, Any]:
    """The rates between two stats records ``dt`` s apart. ``hit_ratio``: the share of
    chunk requests a cache tier (memory, disk, peer) answered rather than the source
    (whole chunks, blocks or small files read alone); None when there were none."""
    def rate(key: str | None) -> float | None:
        return _per_s(cur, prev, key, dt)

    ops_now, ops_before = sum(cur.get("ops", {}).values()), sum(prev.get("ops", {}).values())
    # mb_per_s None, like chunks_per_s, when the record lacks the counter
    tiers = {t: {"chunks_per_s": _r(rate(c)),
                 "mb_per_s": _r(None if (mb := rate(b)) is None else mb / 1e6, 2)}
             for t, (c, b) in TIER_COUNTERS.items()}
    out: dict[str, Any] = {
        "time": round(cur["time"], 3), "interval": round(dt, 3),
        "transport": cur.get("transport"),   # "native io_uring", "native /dev/fuse", "pyfuse3"
        "ops_per_s": _r(max(0, ops_now - ops_before) / dt if dt > 0 else 0.0),
        "reads_per_s": _r(rate("reads")), "read_mb_per_s": _r((rate("read_bytes") or 0) / 1e6, 2),
        # (of them answered by the Python thread: on the native engine, its slow path)
        "python_reads_per_s": _r(rate("python_reads")),
        "hit_ratio": hit_ratio(cur, prev),
        "tiers": tiers,
        "memory_bytes": cur.get("memory_bytes", 0), "disk_bytes": cur.get("disk_bytes", 0),
        "errors_per_s": _r(sum(rate(k) or 0 for k in ("corrupt_discarded", "source_mismatches"))),
        "totals": {k: cur.get(k, 0) for k in ("reads", "python_reads", "read_bytes", "memory_hits",
                                                "disk_hits", "peer_hits", "source_loads",
                                                "source_bytes")}
                  | {"ops": ops_now},
    }
    if "vqps" in cur:                    # a cluster mount: its READs from peers
        latency = cur.get("peer_latency", {})
        out["peer"] = {
            "hedges_per_s": _r(rate("peer_hedges")), "hedges_won_per_s": _r(rate("peer_hedges_won")),
            "unreachable_per_s": _r(rate("peer_unreachable")),
            "checksum_retries_per_s": _r(rate("peer_checksum_retries")),
            "longest_wait_ms": cur.get("peer_longest_wait_ms", 0),
            "vqps": {n: str(s) for n, s in sorted(cur["vqps"].items())},   # "reachable", ...
            "suspected": sorted(n for n, p in latency.items() if p.get("suspected")),
        }
    return out


def hit_ratio(cur: dict[str, Any], prev: dict[str, Any] | None = None) -> float | None:
    """The share of chunk requests a cache tier (memory, disk, peer) answered rather than
    the source, between two stats records (no ``prev``: since the mount began); None
    when there were none."""
    prev = prev or {}
    def delta(key: str) -> int:
        return max(0, int(cur.get(key, 0)) - int(prev.get(key, 0)))

    hits = sum(delta(TIER_COUNTERS[t][0]) for t in ("memory", "disk", "peer"))
    misses = sum(delta(k) for k in ("source_loads", "source_blocks", "source_extents"))
    return round(hits / (hits + misses), 4) if hits + misses else None


MOUNT_COLUMNS = ["TIME", "OPS/S", "READS/S", "MB/S", "HIT%", "MEM/S", "DISK/S", "PEER/S", "SRC/S",
                 "PEER_MB/S", "SRC_MB/S", "HEDGES/S", "MEM_USED"]


def _num(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _pct(ratio: float | None) -> str:
    return "-" if ratio is None else f"{100 * ratio:.1f}"


def size_word(n: float) -> str:
    """``8.0MiB``: one word, so every plain line splits into its columns (awk, cut)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}TiB"


def _mount_row(s: dict[str, Any]) -> list[str]:
    t = s["tiers"]
    return [time.strftime("%H:%M:%S", time.localtime(s["time"])), _num(s["ops_per_s"]),
            _num(s["reads_per_s"]), _num(s["read_mb_per_s"]), _pct(s["hit_ratio"]),
            _num(t["memory"]["chunks_per_s"]), _num(t["disk"]["chunks_per_s"]),
            _num(t["peer"]["chunks_per_s"]), _num(t["source"]["chunks_per_s"]),
            _num(t["peer"]["mb_per_s"]), _num(t["source"]["mb_per_s"]),
            _num(s["peer"]["hedges_per_s"]) if "peer" in s else "-",
            size_word(s["memory_bytes"])]


MOUNT_WIDTHS = [max(len(h), 8) for h in MOUNT_COLUMNS]


def mount_lines(sample: dict[str, Any], first: bool) -> list[str]:
    """The plain form: one line per sample, under a header line before the first."""
    table = Table(MOUNT_COLUMNS, right=range(1, len(MOUNT_COLUMNS)))
    table.add(*_mount_row(sample))
    widths = [max(w, len(c)) for w, c in zip(MOUNT_WIDTHS, table.rows[0], strict=False)]
    return table.lines(header=first, widths=widths)


def _mount_view(s: dict[str, Any], title: str, interval: float,
                first: bool) -> tuple[Any, list[str]]:
    """The terminal form (a title, the served and tier tables, the peer line) and the
    plain lines of one sample."""
    served = Table(["", "OPS/S", "READS/S", "MB/S", "HIT %", "ERRORS/S"], right=range(1, 6))
    served.add("to readers", _num(s["ops_per_s"]), _num(s["reads_per_s"]),
               _num(s["read_mb_per_s"], 2), _pct(s["hit_ratio"]), _num(s["errors_per_s"]))
    tiers = Table(["TIER", "CHUNKS/S", "MB/S", "HOLDS"], right=(1, 2, 3))
    for name in TIERS:
        t = s["tiers"][name]
        holds = {"memory": size_word(s["memory_bytes"]),
                 "disk": size_word(s["disk_bytes"])}.get(name, "")
        tiers.add(name, _num(t["chunks_per_s"]), _num(t["mb_per_s"], 2), holds)
    over = f" over {s['transport']}" if s.get("transport") else ""
    parts: list[Any] = [f"kspeedfs stats: {title}{over}, every {interval:g} s "
                        f"({time.strftime('%H:%M:%S', time.localtime(s['time']))})",
                        served.renderable(), tiers.renderable()]
    if "peer" in s:
        parts.append(_peer_line(s["peer"]))
    return group(*parts), mount_lines(s, first)


def _peer_line(p: dict[str, Any]) -> str:
    links = ", ".join(f"{n} {state}" + (" (suspected)" if n in p["suspected"] else "")
                      for n, state in p["vqps"].items())
    return (f"peer READs: hedged {_num(p['hedges_per_s'])}/s (won {_num(p['hedges_won_per_s'])}/s), "
            f"unreachable {_num(p['unreachable_per_s'])}/s, checksum retries "
            f"{_num(p['checksum_retries_per_s'])}/s, longest wait {p['longest_wait_ms']:g} ms; "
            f"vQPs: {links or 'none'}")


# -- the cluster -------------------------------------------------------------------------

class ClusterReader:
    """The live nodes (signed ``nodes/`` records) and their ``stats`` RPC answers (in the
    shape ``lifecycle.node_stats`` gives them, whatever a node answered)."""

    title = "the cluster"

    def __init__(self, store: Any, secret: bytes) -> None:
        self.store = store
        self.secret = secret

    def __call__(self) -> dict[str, Any]:
        from ..cluster import node_stats as asking
        from ..cluster.lifecycle import node_stats
        from ..cluster.membership import NodeRecord

        live = NodeRecord.list_verified(self.store)
        stats = asking.gather(self.secret, list(live.values()))
        return {"time": time.time(), "live": {n: r.capacity for n, r in live.items()},
                "stats": {n: node_stats(s) for n, s in stats.items()
                          if n in live and isinstance(s, dict)}}


class ClusterRates:
    """Per-node rates from successive ``stats`` answers, each over the time between the
    two answers' own ``time`` stamps."""

    def __init__(self) -> None:
        self.prev: dict[str, dict[str, Any]] = {}
        self.last: dict[str, dict[str, Any]] = {}      # node → its last rates

    def start(self, reading: dict[str, Any]) -> None:
        self.prev = dict(reading["stats"])

    def update(self, reading: dict[str, Any]) -> dict[str, Any]:
        nodes = {}
        for name, capacity in sorted(reading["live"].items()):
            rec = reading["stats"].get(name)
            if rec is None:
                nodes[name] = {"published": False, "capacity": capacity}
                continue
            before = self.prev.get(name)
            if before is not None and rec.get("time", 0) > before.get("time", 0):
                self.last[name] = node_rates(before, rec)
                self.prev[name] = rec
            elif before is None:
                self.prev[name] = rec
            nodes[name] = {"published": True, **self.last.get(name, node_rates(rec, rec)),
                           **node_state(rec, capacity)}
        return {"time": round(reading["time"], 3), "nodes": nodes}


def node_rates(prev: dict[str, Any], cur: dict[str, Any]) -> dict[str, Any]:
    """What one node did between two of its records (0 for the same record twice)."""
    dt = cur.get("time", 0) - prev.get("time", 0)
    c, pc = cur.get("counters", {}), prev.get("counters", {})
    a, pa = cur.get("arena", {}), prev.get("arena", {})
    def rate(new: dict[str, Any], old: dict[str, Any], key: str) -> float:
        return _per_s(new, old, key, dt) or 0.0

    def failed(rec: dict[str, Any]) -> int:
        return sum(p.get("reads_failed_over", 0)
                   for p in rec.get("endpoint", {}).get("peers", {}).values())

    return {
        "source_loads_per_s": _r(rate(c, pc, "source_loads")),
        "peer_loads_per_s": _r(rate(c, pc, "peer_loads")),
        "demand_loads_per_s": _r(rate(c, pc, "demand_loads")),
        "load_mb_per_s": _r((rate(c, pc, "source_bytes") + rate(c, pc, "peer_bytes")) / 1e6, 2),
        "evictions_per_s": _r(rate(a, pa, "evictions")),
        "failovers_per_s": _r(max(0, failed(cur) - failed(prev)) / dt if dt > 0 else 0.0),
    }


def node_state(rec: dict[str, Any], capacity: int) -> dict[str, Any]:
    """A node's cache use and its vQPs' paths, from its last record."""
    a = rec.get("arena", {})
    links: dict[str, dict[str, Any]] = {
        peer: {"state": str(p.get("state", "?")), "paths": dict(p.get("paths", {}))}
        for peer, p in sorted(rec.get("endpoint", {}).get("peers", {}).items())}
    paths = [s for link in links.values() for s in link["paths"].values()]
    return {"used_bytes": a.get("used_bytes", 0), "capacity": a.get("capacity", capacity),
            "used_slots": a.get("used_slots", 0), "nics": rec.get("endpoint", {}).get("nics", []),
            "paths_up": sum(1 for s in paths if s == PATH_UP),
            "paths": len(paths), "links": links, "age_s": round(time.time() - rec.get("time", 0), 1)}


CLUSTER_COLUMNS = ["NODE", "SRC/S", "PEER/S", "DEMAND/S", "LOAD_MB/S", "EVICT/S", "CACHE", "USE%",
                   "PATHS_UP", "FAILOVER/S"]


def cluster_table(sample: dict[str, Any]) -> Table:
    table = Table(CLUSTER_COLUMNS, right=range(1, len(CLUSTER_COLUMNS)))
    for name, n in sample["nodes"].items():
        if not n["published"]:
            table.add(name, *["-"] * 5, f"-/{size_word(n['capacity'])}", "-", "-", "-")
            continue
        table.add(name, _num(n["source_loads_per_s"]), _num(n["peer_loads_per_s"]),
                  _num(n["demand_loads_per_s"]), _num(n["load_mb_per_s"], 2),
                  _num(n["evictions_per_s"]),
                  f"{size_word(n['used_bytes'])}/{size_word(n['capacity'])}",
                  _pct(n["used_bytes"] / n["capacity"] if n["capacity"] else None),
                  f"{n['paths_up']}/{n['paths']}", _num(n["failovers_per_s"]))
    return table


def cluster_trouble(sample: dict[str, Any]) -> list[str]:
    """One line per vQP that is not UP or has a path that is not UP; nodes with no record."""
    out = []
    for name, n in sample["nodes"].items():
        if not n["published"]:
            out.append(f"{name}: no stats record yet")
            continue
        for peer, link in n["links"].items():
            down = [p for p, s in link["paths"].items() if s != PATH_UP]
            if down or link["state"] != VQP_UP:
                paths = ", ".join(f"{p} {s}" for p, s in link["paths"].items())
                out.append(f"{name} to {peer}: {link['state']} ({paths})")
    return out


def cluster_lines(sample: dict[str, Any]) -> list[str]:
    """The plain form of one sample: a time line, the node table, the paths not UP."""
    stamp = time.strftime("%H:%M:%S", time.localtime(sample["time"]))
    return ([f"{stamp}  {len(sample['nodes'])} live node(s)"]
            + [f"  {line}" for line in cluster_table(sample).lines()]
            + [f"  {line}" for line in cluster_trouble(sample)])


def _cluster_view(s: dict[str, Any], title: str, interval: float,
                  first: bool) -> tuple[Any, list[str]]:
    """The terminal form (a title, the node table, the trouble lines) and the plain lines."""
    stamp = time.strftime("%H:%M:%S", time.localtime(s["time"]))
    trouble = cluster_trouble(s)
    parts: list[Any] = [f"kspeedfs stats: {len(s['nodes'])} live node(s), every {interval:g} s "
                        f"({stamp}; nodes publish every 2 s)", cluster_table(s).renderable()]
    parts += trouble or ["every vQP reachable, every path UP"]
    return group(*parts), cluster_lines(s)
