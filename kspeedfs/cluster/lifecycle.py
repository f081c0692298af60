"""A dataset's life in the pooled cache: preload requests, the mounts that hold a
version, the capacity plan a preload must pass, and the rule that removes old versions.

etcd keys (under ``store.etcd_prefix``)::

    preload/<ds>             PreloadRequest: {version, requested, priority, release}
    mounts/<ds>@<v>/<id>     MountRecord, on the mount daemon's own lease: who reads
                             which version (``rm`` refuses it, ``status`` shows it)

Priority. Every preload has a priority (``kspeedfs preload --priority``, default 0). A
node's arena evicts chunks outside its share (not an owner any more, or of no preloaded
dataset) first, oldest first, then the chunks of the lowest-priority dataset; never one
of a higher priority for a chunk of its share, nor, without an SSD tier, one of the same
(``cluster/arena.py``, ``Reconciler.rank``). A preload is planned before it is requested
(:func:`plan`), so a job's preload cannot silently push out the dataset another job
trains on: it must fit beside every dataset of equal or higher priority, or it is
refused.

Capacity rule (:func:`plan`). A version needs ``chunks × R`` arena slots (a slot holds
one chunk whatever its length, so slots, not bytes, are what fill up); the cluster
offers the slots of every live node plus its SSD tiers (``cache.disk``, where evicted
owned chunks go). Example: 3 nodes × 64 MiB arenas of 256 KiB slots = 768 slots; a
dataset of 300 chunks at R=2 needs 600 of them; a second one of 200 chunks needs 400
more and does not fit (1000 > 768): refused, or, with a higher priority and
``--evict``, the lower-priority one is unloaded first. Datasets of equal or higher
priority are never evicted by a plan.

Version rule (:func:`collectable`): of a dataset's versions, keep the newest
``store.keep_versions`` and every version a live mount holds or a preload names;
``kspeedfs gc`` (and ``kspeedfs import``, for the dataset it imported) removes the rest
from the store; nodes drop the chunks of versions no longer preloaded. A live mount is
one with a ``mounts/`` record, or, with either store, one this machine serves
(``fuse/registry.py``: a single machine has no etcd to hold its mounts in).

Release on last mount (``kspeedfs mount --preload --unload-on-exit``): the mount holds
its version through ``mounts/``, on its lease; the preload says ``release:
last-mount``. A mount leaving cleanly releases the preload if no other mount holds it;
a crashed mount's hold vanishes with its lease and the first live node releases the
preload ``tuning.RELEASE_GRACE_TTLS`` lease TTLs later (:func:`release_if_unheld`, a
compare-and-delete, so a mount arriving meanwhile keeps it).

Every record is parsed by a ``from_json`` that takes untrusted JSON and raises only
``ValueError``; what nodes publish for the CLI (``stats/<node>``, ``progress/``) is read
by :func:`node_stats` and :func:`count`, which take any JSON and never raise (all fuzzed
in ``tests/unit/test_lifecycle.py``).
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, TypeGuard

from ..errors import CapacityExceeded, StoreError
from ..manifest.store.signature import canonical_json

log = logging.getLogger(__name__)

RELEASES = ("manual", "last-mount")
_I64 = (1 << 63) - 1


def count(record: object, name: str) -> int:
    """A count a node published in etcd (its progress or stats record: any JSON): the
    value of ``name`` when it is a non-negative int, else 0."""
    v = record.get(name) if isinstance(record, dict) else None
    return v if _is_count(v) else 0


def node_stats(raw: object) -> dict[str, Any]:
    """A node's ``stats/<node>`` record (``NodeStatistics``, as etcd holds it: any JSON)
    in the shape the CLI reads it, whatever it holds: ``time`` a finite number (else 0);
    ``arena``, ``counters``, ``disk``, ``files`` their counts (``count``); ``progress`` a count
    table per dataset; ``reads`` its numbers, ``peer_latency`` per peer (``counts`` a
    list of counts, ``reads``, ``suspected``) and ``peer_latency_buckets_ms`` (finite
    numbers); ``endpoint`` its ``nics`` (strings) and ``peers`` (``state``, ``paths``
    as strings, ``reads_failed_over``). What does not fit is left out, so one malformed
    record (a node of another version, a hand edit) costs its own fields, not the
    command (fuzzed in ``tests/unit/test_lifecycle.py``)."""
    r = _obj(raw)
    reads = _obj(r.get("reads"))
    out_reads: dict[str, Any] = {k: v for k, v in reads.items() if _number(v) is not None}
    out_reads["peer_latency"] = {
        peer: {"reads": count(p, "reads"), "suspected": _obj(p).get("suspected") is True,
               "counts": [c if _is_count(c) else 0 for c in _list(_obj(p).get("counts"))]}
        for peer, p in _obj(reads.get("peer_latency")).items()}
    out_reads["peer_latency_buckets_ms"] = [
        b for b in _list(reads.get("peer_latency_buckets_ms")) if _number(b) is not None]
    endpoint = _obj(r.get("endpoint"))
    return {
        "node": r.get("node") if isinstance(r.get("node"), str) else "",
        "time": _number(r.get("time")) or 0.0,
        "arena": _counts(r.get("arena")), "counters": _counts(r.get("counters")),
        "disk": _counts(r.get("disk")), "files": _counts(r.get("files")),
        "progress": {tag: _counts(v) for tag, v in _obj(r.get("progress")).items()},
        "reads": out_reads,
        "endpoint": {
            "nics": [n for n in _list(endpoint.get("nics")) if isinstance(n, str)],
            "peers": {peer: {"state": _text(_obj(p).get("state")),
                             "paths": {k: _text(v) for k, v in _obj(_obj(p).get("paths")).items()},
                             "reads_failed_over": count(p, "reads_failed_over")}
                      for peer, p in _obj(endpoint.get("peers")).items()}},
    }


def _obj(x: object) -> dict[str, Any]:
    return x if isinstance(x, dict) else {}


def _list(x: object) -> list[Any]:
    return x if isinstance(x, list) else []


def _text(x: object) -> str:
    return x if isinstance(x, str) else "?"


def _is_count(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _counts(x: object) -> dict[str, int]:
    return {k: v for k, v in _obj(x).items() if _is_count(v)}


def _number(v: object) -> float | int | None:
    """``v`` when it is a finite, non-negative number (not a bool), else None."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        return v if math.isfinite(v) and v >= 0 else None
    except OverflowError:           # an int too large for a float
        return None


def _json_object(raw: bytes, what: str) -> dict[str, Any]:
    try:
        d = json.loads(raw)
    except RecursionError:
        raise ValueError(f"{what} nested too deeply") from None
    if not isinstance(d, dict):
        raise ValueError(f"a {what} must be a JSON object")
    return d


def _int(d: dict[str, Any], key: str, default: int | None, lo: int, hi: int, what: str) -> int:
    v = d.get(key, default)
    if type(v) is not int or not lo <= v <= hi:
        raise ValueError(f"{what}: {key} is not an integer in {lo}..{hi}")
    return v


def _time(d: dict[str, Any], key: str, what: str) -> float:
    v = d.get(key, 0.0)
    if not ((type(v) is int and abs(v) <= _I64) or (type(v) is float and math.isfinite(v))):
        raise ValueError(f"{what}: {key} is not a finite number")
    return float(v)


def _str(d: dict[str, Any], key: str, what: str, limit: int = 4096) -> str:
    v = d.get(key)
    if not isinstance(v, str) or not 0 < len(v) <= limit:
        raise ValueError(f"{what}: {key} is not a string of 1..{limit} characters")
    return v


@dataclass(frozen=True)
class PreloadRequest:
    """``preload/<ds>``: the cluster should hold version ``version`` of ``ds``."""

    version: int
    requested: float = 0.0
    priority: int = 0
    release: str = "manual"          # or "last-mount": released when no mount holds it

    @staticmethod
    def key(prefix: str, name: str) -> str:
        return f"{prefix}preload/{name}"

    def to_json(self) -> bytes:
        return canonical_json(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes) -> PreloadRequest:
        """Parse untrusted JSON (records of older versions had only version/requested)."""
        d = _json_object(raw, "preload request")
        release = d.get("release", "manual")
        if release not in RELEASES:
            raise ValueError(f"preload request: release {release!r} is not one of {RELEASES}")
        return cls(version=_int(d, "version", None, 1, _I64, "preload request"),
                   requested=_time(d, "requested", "preload request"),
                   priority=_int(d, "priority", 0, -1000, 1000, "preload request"),
                   release=release)


@dataclass(frozen=True)
class MountRecord:
    """``mounts/<ds>@<v>/<host>:<pid>``: a live mount of one version, on its lease."""

    dataset: str
    version: int
    host: str
    mountpoint: str
    pid: int
    started: float = field(default_factory=time.time)
    unload_on_exit: bool = False
    reads: dict[str, int] = field(default_factory=dict)    # hits/misses/bytes (stats.py)

    @property
    def tag(self) -> str:
        return f"{self.dataset}@{self.version}"

    def key(self, prefix: str) -> str:
        return f"{prefix}mounts/{self.tag}/{self.host}:{self.pid}"

    def to_json(self) -> bytes:
        return canonical_json(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes) -> MountRecord:
        what = "mount record"
        d = _json_object(raw, what)
        unload = d.get("unload_on_exit", False)
        if type(unload) is not bool:
            raise ValueError(f"{what}: unload_on_exit is not a boolean")
        reads = d.get("reads", {})
        if not isinstance(reads, dict) or len(reads) > 256 or not all(
                isinstance(k, str) and len(k) <= 64 and type(v) is int and 0 <= v <= _I64
                for k, v in reads.items()):
            raise ValueError(f"{what}: reads is not a map of counters")
        return cls(dataset=_str(d, "dataset", what, 255), version=_int(d, "version", None, 1, _I64, what),
                   host=_str(d, "host", what, 255), mountpoint=_str(d, "mountpoint", what),
                   pid=_int(d, "pid", None, 1, 1 << 22, what), started=_time(d, "started", what),
                   unload_on_exit=unload, reads=dict(reads))


# -- reading the records (blocking; the CLI and the daemons' worker threads) ---------------

def preloads(store: Any) -> dict[str, PreloadRequest]:
    """Every well-formed ``preload/`` request by dataset name (others: a warning each)."""
    pre = store.prefix + "preload/"
    out = {}
    for kv in store.call(lambda c: c.get_prefix_response(pre)).kvs:
        name = kv.key.decode(errors="replace")[len(pre):]
        try:
            out[name] = PreloadRequest.from_json(kv.value)
        except ValueError as e:
            log.warning("ignoring malformed preload request for %s: %s", name, e)
    return out


def mounts(store: Any, name: str | None = None) -> dict[str, list[MountRecord]]:
    """Live mounts by version tag (``ds@v``), of one dataset or of all."""
    pre = store.prefix + "mounts/" + (f"{name}@" if name else "")
    out: dict[str, list[MountRecord]] = {}
    for kv in store.call(lambda c: c.get_prefix_response(pre)).kvs:
        try:
            rec = MountRecord.from_json(kv.value)
        except ValueError as e:
            log.warning("ignoring malformed mount record %s: %s",
                        kv.key.decode(errors="replace"), e)
            continue
        if name is None or rec.dataset == name:
            out.setdefault(rec.tag, []).append(rec)
    return out


def request_preload(store: Any, name: str, req: PreloadRequest) -> None:
    store.call(lambda c: c.put(PreloadRequest.key(store.prefix, name), req.to_json()))


def unload(store: Any, name: str) -> PreloadRequest | None:
    """Take ``name`` out of the pooled cache: its preload request and progress go; the
    nodes drop its chunks (``Reconciler.reconcile``). Returns the request that was removed."""
    key = PreloadRequest.key(store.prefix, name)
    value, _ = store.call(lambda c: c.get(key))
    store.call(lambda c: c.delete(key))
    store.call(lambda c: c.delete_prefix(f"{store.prefix}progress/{name}@"))
    if value is None:
        return None
    try:
        return PreloadRequest.from_json(value)
    except ValueError:
        return None


def release_if_unheld(store: Any, name: str, grace: float, now: float | None = None) -> bool:
    """Delete ``preload/<name>`` if it says ``release: last-mount``, no live mount holds
    its version, and it was requested more than ``grace`` s ago; a compare-and-delete
    on the record's revision, so a mount that re-requests it meanwhile keeps it."""
    key = PreloadRequest.key(store.prefix, name)
    value, meta = store.call(lambda c: c.get(key))
    if value is None:
        return False
    try:
        req = PreloadRequest.from_json(value)
    except ValueError:
        return False
    now = time.time() if now is None else now
    if req.release != "last-mount" or now - req.requested < grace:
        return False
    if mounts(store, name).get(f"{name}@{req.version}"):
        return False
    ok, _ = store.call(lambda c: c.transaction(
        compare=[c.transactions.mod(key) == meta.mod_revision],
        success=[c.transactions.delete(key)], failure=[]))
    if ok:
        store.call(lambda c: c.delete_prefix(f"{store.prefix}progress/{name}@"))
        log.info("released the preload of %s@%d: no mount holds it any more", name, req.version)
    return bool(ok)


# -- the capacity plan ---------------------------------------------------------------------

@dataclass(frozen=True)
class Holding:
    """A preloaded dataset version as the plan counts it."""

    name: str
    version: int
    chunks: int
    priority: int
    requested: float = 0.0

    @property
    def tag(self) -> str:
        return f"{self.name}@{self.version}"


@dataclass(frozen=True)
class CapacityPlan:
    """What a preload of ``new`` would take, in arena slots (see the module docstring).

    ``fits``: it fits beside everything held; else ``evict`` lists the lower-priority
    holdings whose unloading makes it fit (empty: nothing can make it fit)."""

    new: Holding
    replicas: int
    slot_size: int
    memory_slots: int                # every live node's arena
    disk_slots: int                  # every SSD tier, in slots of slot_size
    held: list[Holding]
    fits: bool
    in_memory: bool
    evict: list[Holding]

    def slots(self, h: Holding) -> int:
        return h.chunks * self.replicas

    @property
    def need(self) -> int:
        return self.slots(self.new)

    @property
    def used(self) -> int:
        return sum(self.slots(h) for h in self.held)

    def gib(self, slots: int) -> str:
        return f"{slots * self.slot_size / 2**30:.2f} GiB"

    def describe(self) -> str:
        """One line an operator can act on."""
        held = ", ".join(f"{h.tag} {self.gib(self.slots(h))} (priority {h.priority})"
                         for h in self.held) or "nothing"
        head = (f"{self.new.tag} needs {self.gib(self.need)} ({self.new.chunks:,} chunks × R="
                f"{self.replicas} slots of {self.slot_size >> 10} KiB); the cluster has "
                f"{self.gib(self.memory_slots)} of memory + {self.gib(self.disk_slots)} of SSD, "
                f"held: {held}")
        if self.fits:
            where = "in memory" if self.in_memory else "partly on the SSD tier"
            return f"{head}; it fits {where}"
        if self.evict:
            return (f"{head}; it fits only if " + ", ".join(h.tag for h in self.evict)
                    + " (lower priority) is unloaded: run again with --evict to do that")
        return (f"{head}; it does not fit beside datasets of equal or higher priority "
                "(unload one, add nodes or memory, or --force)")


def plan(new: Holding, held: list[Holding], replicas: int, slot_size: int,
         memory_slots: int, disk_bytes: int) -> CapacityPlan:
    """Does ``new`` fit beside ``held`` (the other preloaded versions)? Pure."""
    held = [h for h in held if h.name != new.name]          # a new version replaces the old
    disk_slots = disk_bytes // max(slot_size, 1)
    total = memory_slots + disk_slots
    need = new.chunks * replicas
    used = sum(h.chunks * replicas for h in held)
    fits = used + need <= total
    evict: list[Holding] = []
    if not fits:
        lower = sorted((h for h in held if h.priority < new.priority),
                       key=lambda h: (h.priority, h.requested))
        free = total - used
        for h in lower:
            evict.append(h)
            free += h.chunks * replicas
            if free >= need:
                break
        else:
            evict = []
    return CapacityPlan(new, replicas, slot_size, memory_slots, disk_slots, held, fits,
                        used + need <= memory_slots, evict)


def cluster_plan(store: Any, name: str, version: int, chunks: int, priority: int,
                 replicas: int) -> CapacityPlan:
    """Blocking: the plan of preloading ``name@version`` against the live cluster
    (node records for arenas and SSD tiers, ``preload/`` for what is held). A record of
    an earlier node version has no SSD capacity: its ``stats/`` record's is read."""
    from .membership import NodeRecord, list_json

    nodes = NodeRecord.list_verified(store)
    if not nodes:
        raise StoreError("no live nodes (start `kspeedfs node` on the training nodes)")
    slot = min(r.slot_size for r in nodes.values())
    memory_slots = sum(r.nslots for r in nodes.values())
    disk = sum(r.disk_capacity or 0 for r in nodes.values())
    earlier = {n for n, r in nodes.items() if r.disk_capacity is None}
    if earlier:
        stats = list_json(store, "stats/")
        disk += sum(node_stats(s)["disk"].get("capacity", 0) for n, s in stats.items()
                    if n in earlier)
    held = []
    for other, req in preloads(store).items():
        if other == name:
            continue
        try:
            info = store.dataset(other, req.version)
        except StoreError:
            continue                    # removed meanwhile: holds nothing
        held.append(Holding(other, req.version, info.chunks, req.priority, req.requested))
    return plan(Holding(name, version, chunks, priority, time.time()), held, replicas, slot,
                memory_slots, disk)


def request_planned(store: Any, name: str, version: int, chunks: int, replicas: int,
                    priority: int = 0, release: str = "manual", evict: bool = False,
                    force: bool = False) -> tuple[CapacityPlan, list[str]]:
    """Blocking: plan, then request the preload of ``name@version``. Raises
    ``CapacityExceeded`` (with the plan's line) when it does not fit, unless ``evict``
    and unloading lower-priority datasets makes it fit (they are unloaded: returned),
    or ``force``. A request already there for the same version keeps the higher
    priority, and stays ``manual`` if either asks for that (a ``--unload-on-exit``
    mount never turns someone's standing preload into a temporary one)."""
    p = cluster_plan(store, name, version, chunks, priority, replicas)
    unloaded: list[str] = []
    if not p.fits and not force:
        if not (evict and p.evict):
            raise CapacityExceeded(p.describe())
        for h in p.evict:
            unload(store, h.name)
            unloaded.append(h.tag)
            log.info("unloaded %s (priority %d) to make room for %s@%d", h.tag, h.priority,
                     name, version)
    old = preloads(store).get(name)
    if old is not None and old.version == version:
        priority = max(priority, old.priority)
        if old.release == "manual":
            release = "manual"
    request_preload(store, name, PreloadRequest(version, time.time(), priority, release))
    return p, unloaded


# -- the version rule ----------------------------------------------------------------------

def collectable(versions: list[int], keep: int, pinned: set[int]) -> list[int]:
    """The versions the rule removes: all but the newest ``keep`` (0: keep all), never a
    pinned one (mounted or preloaded). Pure."""
    if keep <= 0:
        return []
    newest = set(sorted(versions)[-keep:])
    return [v for v in sorted(versions) if v not in newest and v not in pinned]


def pinned_versions(store: Any, name: str) -> dict[int, str]:
    """Version → why it must stay: mounted where (this machine's mounts of ``store``,
    ``fuse/registry.py``, with any store; every host's ``mounts/`` records with etcd),
    or preloaded (etcd)."""
    from ..fuse import registry

    where: dict[int, list[str]] = {}
    host = os.uname().nodename
    for m in registry.live(store.identity):
        if m.dataset == name:
            where.setdefault(m.version, []).append(f"{host}:{m.mountpoint}")
    cluster = hasattr(store, "call")     # etcd: every host's holds, and the preloads
    for tag, recs in (mounts(store, name) if cluster else {}).items():
        v = int(tag.rsplit("@", 1)[1])
        where.setdefault(v, []).extend(f"{r.host}:{r.mountpoint}" for r in recs)
    why = {v: "mounted at " + ", ".join(dict.fromkeys(w)) for v, w in sorted(where.items())}
    req = preloads(store).get(name) if cluster else None
    if req is not None:
        why.setdefault(req.version, "preloaded")
    return why


def collect(store: Any, name: str, keep: int, dry_run: bool = False) -> list[int]:
    """Apply the version rule to ``name``; returns the versions removed (or, dry, that
    would be)."""
    gone = collectable(store.versions(name), keep, set(pinned_versions(store, name)))
    if not dry_run:
        for v in gone:
            store.remove(name, v)
            log.info("gc: removed %s v%d (store.keep_versions=%d)", name, v, keep)
    return gone
