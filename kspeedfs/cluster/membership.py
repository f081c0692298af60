"""Membership in etcd: a node's leased record, and everyone's live view of the cluster.

Keys (``P`` = ``store.etcd_prefix``)::

    P nodes/<node>                   NodeRecord JSON, attached to the node's lease
    P preload/<dataset>              {"version": N}: the cluster should hold this version
    P progress/<dataset>@<N>/<node>  a node's preload progress (also on its lease)
    P stats/<node>                   a node's statistics, from nodes of earlier versions
                                     only (now asked over the ``stats`` RPC)

A node puts its record with a lease of ``cluster.lease_ttl`` seconds and refreshes it
every third of that; when the node dies the lease expires and etcd deletes every key
on it, which is how the others learn (no separate failure detector for *membership*:
vRDMA heartbeats already detect a dead peer in ~50 ms for the read path, the lease
decides when its chunks are re-replicated). A lease lost anyway (etcd restored from a
snapshot, a long partition) is re-granted and the keys put again.

Rails. Every keep-alive and every put on the lease goes to one etcd endpoint, the last
one that answered (``EtcdStore.call``), and to the next after
``store.etcd_attempt_timeout`` without an answer; a keep-alive's whole budget is one
refresh period. So a cut NIC, a whole rail down or a stopped member costs one attempt
timeout (shorter than a period) once, and no refresh, for any length of time, while one
endpoint reaches etcd; the timeout arithmetic against the TTL is in docs/design.md
("etcd across rails"). They used to be raced on every endpoint, and with every etcd
member an endpoint etcd applied each put three times (docs/design.md, "1,000 nodes,
simulated").

Flaps. A node whose record disappears stays a member (placement unchanged, nothing
re-replicated) for ``cluster.leave_grace`` seconds; back within that, nobody noticed.
Only after the grace does it leave :attr:`Membership.members` and the survivors copy its
share. The cost: a node that really died keeps R-1 live copies of its chunks for
``lease_ttl + leave_grace`` (10 s by default) instead of ``lease_ttl``; readers skip it
meanwhile on their own (a refused or silent peer is a failed replica).

Views (:class:`PrefixView`) watch a prefix: list it (remembering the revision), then
watch from the next revision and apply its events (each carries the key's new value,
or its deletion) to the listed values as they arrive, on one stream until the resync
deadline (a stream per change cost etcd 2N stream set-ups); they list again only when
etcd says the watch's revision was compacted, on an error, or on a response that is not
what was asked for. Every ``resync`` seconds the watch is renewed, from the last
revision seen: a
quiet watch missed nothing, so a quiet period costs a one-key read (etcd's revision: a
restored etcd going back in time lists again), not a listing of the whole prefix.
Listing on every resync, then on every change, was the cluster's largest etcd load:
N views × N records every 10 s, and each change cost 2N listings of N records, 3 × with
every member an endpoint (``bench.cluster_sim``; docs/design.md, "1,000 nodes,
simulated"). Values from events reach ``on_change`` exactly as listed ones do, so node
records from either pass the same signature and checks (:meth:`NodeRecord.verified`).
Readers consult the view's in-memory copy; nothing on the read path talks to etcd. If etcd is
unreachable the view keeps the last membership it saw and says so in the log once; it
catches up when etcd is back. A mount's view also keeps the last values it saw in a file
(``keep``, under /run/kspeedfs/mounts, root only), and the daemon that takes the mount
over (a resume after a crash, an upgrade) starts from that file when etcd does not list
the prefix in time (``seed``): during an etcd outage its reads go to the peers its
predecessor knew, not to the source. The file's values pass the same record checks as
etcd's (``NodeRecord.verifying``: signed with the cluster secret).
"""
from __future__ import annotations

import base64
import binascii
import ipaddress
import json
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import trio

from ..errors import ConfigError, RecordUnverified, StoreError
from ..manifest.store.etcd import EtcdStore
from ..manifest.store.etcd_client import WatchBatch
from ..manifest.store.signature import canonical_json, warn_refused
from .placement import Member

log = logging.getLogger(__name__)


_I64 = (1 << 63) - 1


@dataclass(frozen=True)
class NodeRecord:
    """What a node publishes about itself (``P nodes/<node>``).

    Signed. The value at ``P nodes/<node>`` is :meth:`signed` with the store's record
    signer (a key derived from the cluster secret, ``manifest/store/signature.py``) for
    exactly that key; :meth:`verified` drops every value that does not verify, or whose
    ``node`` is not its key, before anything parses it further. So a record written
    to etcd without the cluster secret (a fake node, or a node started with the wrong
    secret) never enters a membership view, placement or ``kspeedfs status``; each
    refusal is logged once per (key, value). :meth:`from_json` takes untrusted JSON and
    returns a well-typed record or raises ``ValueError`` (never ``TypeError``,
    ``KeyError`` or ``RecursionError``)."""

    node: str
    host: str
    nics: list[str]
    port: int                  # vRDMA endpoint: control connections, path setup
    rpc_port: int              # load-on-demand and status RPC
    capacity: int              # arena bytes: the placement weight
    nslots: int
    slot_size: int
    nbuckets: int
    started: float = field(default_factory=time.time)
    # the SSD tier's bytes, for ``cluster_plan``; None: a node of an earlier version,
    # which publishes it only in ``stats/<node>``
    disk_capacity: int | None = None

    def to_json(self) -> bytes:
        return canonical_json(asdict(self))

    def signed(self, store: EtcdStore) -> bytes:
        """The value to put at this node's key: the record, signed for that key."""
        if store.signer is None:
            raise ConfigError("node records are signed with the cluster secret; the store has none")
        return store.signer.seal(self.key(store, self.node), self.to_json())

    @staticmethod
    def key(store: EtcdStore, node: str) -> str:
        return f"{store.prefix}nodes/{node}"

    @classmethod
    def from_json(cls, raw: bytes) -> NodeRecord:
        """Parse and type-check untrusted JSON; ``ValueError`` for anything invalid."""
        try:
            d = json.loads(raw)
        except RecursionError:
            raise ValueError("node record nested too deeply") from None
        if not isinstance(d, dict):
            raise ValueError("a node record must be a JSON object")
        fields = cls.__dataclass_fields__
        d = {k: v for k, v in d.items() if k in fields}
        missing = sorted(set(fields) - set(d) - {"started", "disk_capacity"})
        if missing:
            raise ValueError(f"node record lacks {', '.join(missing)}")
        for key in ("node", "host"):
            if not isinstance(d[key], str) or not 0 < len(d[key]) <= 255:
                raise ValueError(f"node record: {key} is not a name")
        nics = d["nics"]
        if not isinstance(nics, list) or not 0 < len(nics) <= 64 or not all(
                isinstance(n, str) and len(n) <= 64 for n in nics):
            raise ValueError("node record: nics is not a list of addresses")
        for n in nics:
            ipaddress.ip_address(n)            # ValueError when it is not an address
        for key, hi in (("port", 65535), ("rpc_port", 65535), ("capacity", _I64),
                        ("nslots", _I64), ("slot_size", _I64), ("nbuckets", _I64)):
            if type(d[key]) is not int or not 0 <= d[key] <= hi:
                raise ValueError(f"node record: {key} is not an integer in 0..{hi}")
        disk = d.get("disk_capacity")
        if disk is not None and (type(disk) is not int or not 0 <= disk <= _I64):
            raise ValueError(f"node record: disk_capacity is not an integer in 0..{_I64}")
        started = d.get("started", 0.0)
        if not ((type(started) is int and abs(started) <= _I64)
                or (type(started) is float and math.isfinite(started))):
            raise ValueError("node record: started is not a finite number")
        return cls(**d)

    @classmethod
    def verified(cls, store: EtcdStore, values: dict[str, bytes]) -> dict[str, bytes]:
        """The entries of a listing of ``P nodes/`` (suffix → value) whose value is
        signed for its key with this cluster's key and names that node; values are
        returned as the bare record JSON. The others are dropped (logged once each)."""
        if store.signer is None:
            raise ConfigError("node records are verified with the cluster secret; the store has none")
        out = {}
        for suffix, raw in values.items():
            key = cls.key(store, suffix)
            try:
                payload = store.signer.open(key, raw)
                if cls.from_json(payload).node != suffix:
                    raise ValueError("its node is not its key")
            except RecordUnverified:
                continue
            except ValueError as e:
                warn_refused(key, raw, f"malformed node record ({e})")
                continue
            out[suffix] = payload
        return out

    @classmethod
    def verifying(cls, store: EtcdStore,
                  decode: Callable[[dict[str, bytes]], None]) -> Callable[[dict[str, bytes]], None]:
        """``decode`` behind :meth:`verified`: the on-change hook of a ``nodes/`` view."""
        if store.signer is None:
            raise ConfigError("membership verifies node records with the cluster secret "
                              "(cluster.secret_file); the store has none")
        return lambda values: decode(cls.verified(store, values))

    @classmethod
    def list_verified(cls, store: EtcdStore) -> dict[str, NodeRecord]:
        """Blocking, for the CLI: every live node whose record verifies, by name."""
        pre = store.prefix + "nodes/"
        resp = store.call(lambda c: c.get_prefix_response(pre))
        values = {kv.key.decode(errors="surrogateescape")[len(pre):]: kv.value for kv in resp.kvs}
        return {k: cls.from_json(v) for k, v in cls.verified(store, values).items()}

    def member(self) -> Member:
        return Member(self.node, max(self.capacity, 1) / (1 << 30))


def list_json(store: EtcdStore, sub: str) -> dict[str, Any]:
    """Blocking, for the CLI: every key under ``P sub`` (suffix → decoded JSON). Keys
    that do not hold JSON are skipped."""
    pre = store.prefix + sub
    out = {}
    for kv in store.call(lambda c: c.get_prefix_response(pre)).kvs:
        try:
            out[kv.key.decode()[len(pre):]] = json.loads(kv.value)
        except ValueError:
            log.warning("ignoring malformed %s", kv.key.decode(errors="replace"))
    return out


def default_node_name() -> str:
    return socket.gethostname()


class Registration:
    """Keeps keys alive on this node's lease for as long as :meth:`run` runs."""

    def __init__(self, store: EtcdStore, ttl: int) -> None:
        self.store = store
        self.ttl = ttl
        self.lease_id: int | None = None
        self._keys: dict[str, bytes] = {}
        self._lock = threading.Lock()
        # held across a grant: the first put and the keep-alive task (daemon._hold starts
        # both at once) each found no lease and each granted one; the second lapsed
        self._granting = threading.Lock()

    @property
    def period(self) -> float:
        """Seconds between keep-alives: a third of the TTL (docs/design.md)."""
        return self.ttl / 3

    def _grant(self) -> None:
        # call, not race: two endpoints answering would grant two leases
        lease = self.store.call(lambda c: c.lease(self.ttl))
        self.lease_id = lease.id
        with self._lock:
            keys = dict(self._keys)
        for k, v in keys.items():
            def put(c: Any, k: str = k, v: bytes = v) -> Any:
                return c.put(k, v, lease=lease.id)
            self.store.call(put)
        log.info("etcd lease %x granted (ttl %ds); %d keys attached", self.lease_id, self.ttl, len(keys))

    def put(self, key: str, value: bytes) -> None:
        """Blocking: put ``key`` on the lease (and remember it for a re-grant)."""
        with self._lock:
            self._keys[key] = value
        with self._granting:
            if self.lease_id is None:
                self._grant()                # puts every remembered key, this one too
                return
        lease_id = self.lease_id             # granted by whoever got here first
        self.store.call(lambda c: c.put(key, value, lease=lease_id))

    def forget(self, key: str) -> None:
        """Stop re-attaching ``key`` after a re-grant (no etcd request: whoever removed
        the thing it describes deletes the key)."""
        with self._lock:
            self._keys.pop(key, None)

    def _refresh(self) -> None:
        if self.lease_id is None:
            with self._granting:
                if self.lease_id is None:
                    self._grant()
            return
        lease_id = self.lease_id
        # one member, the next one after an attempt timeout (A <= P); a refresh that no
        # member answers within a period is retried by the next one (docs/design.md,
        # "etcd across rails": two periods fit in the TTL)
        if self.store.keep_alive(lease_id, budget=self.period) <= 0:
            log.warning("etcd lease %x expired; registering again", lease_id)
            with self._granting:
                if self.lease_id == lease_id:
                    self._grant()

    async def run(self) -> None:
        """Refresh every ttl/3; etcd outages are logged and ridden out."""
        down = False
        while True:
            started = trio.current_time()
            try:
                await trio.to_thread.run_sync(self._refresh)
                if down:
                    log.info("etcd reachable again; lease %x refreshed", self.lease_id)
                down = False
            except StoreError as e:
                if not down:
                    log.warning("cannot refresh the membership lease: %s", e)
                down = True
            except Exception:               # a client bug must not take the node down
                log.exception("refreshing the membership lease failed")
                down = True
            await trio.sleep_until(started + self.period)

    def revoke(self) -> None:
        """Blocking: leave the cluster now (clean shutdown) instead of after the TTL."""
        if self.lease_id is not None:
            lease_id, self.lease_id = self.lease_id, None
            try:
                self.store.call(lambda c: c.revoke_lease(lease_id))
            except StoreError as e:
                log.warning("cannot revoke lease %x: %s", lease_id, e)


def apply_events(values: dict[str, bytes], prefix: str,
                 events: list[tuple[bytes, bytes | None]]) -> dict[str, bytes]:
    """``values`` (by key suffix) with each etcd key under ``prefix`` set to its value
    (None: deleted), as a new dict; keys come from etcd (untrusted). A key that is not
    UTF-8 or not under ``prefix`` is left out: no record can name it (a non-UTF-8 key
    used to make every listing fail)."""
    out = dict(values)
    for key, value in events:
        try:
            name = key.decode()
        except UnicodeDecodeError:
            log.warning("ignoring etcd key %r: not UTF-8", key[:200])
            continue
        if not name.startswith(prefix):
            continue
        if value is None:
            out.pop(name[len(prefix):], None)
        else:
            out[name[len(prefix):]] = value
    return out


class PrefixView:
    """An in-memory copy of every key under a prefix, kept current by a watch.

    ``values`` maps the key's suffix to its raw value; ``revision`` counts changes seen;
    ``changed`` is an Event replaced (set) on every change. ``on_change`` runs in the
    trio thread after each change."""

    def __init__(self, store: EtcdStore, prefix: str, resync: float = 10.0,
                 on_change: Callable[[dict[str, bytes]], None] | None = None,
                 first_wait: float | None = None, keep: str | None = None,
                 seed: bool = False) -> None:
        """``first_wait``: how long ``run`` waits for the first listing before it reports
        started (default: one ``etcd_timeout`` and a second). ``keep``: a file the values
        are written to on every change; ``seed``: with nothing listed after
        ``first_wait``, start from that file's values (``last_known``)."""
        self.store = store
        self.keep = keep
        self.seed = seed
        self.prefix = store.prefix + prefix
        self.resync = resync
        self.first_wait = store.timeout + 1 if first_wait is None else first_wait
        self.on_change = on_change
        self.values: dict[str, bytes] = {}
        self.revision = 0
        self.changed = trio.Event()
        self.listed = trio.Event()          # set after the first successful listing
        self._stop = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None

    def _list(self) -> tuple[dict[str, bytes], int]:
        # one endpoint, as the watch: a listing is rare now (the watch's events are
        # applied), and raced it was served by every etcd member
        resp = self.store.call(lambda c: c.get_prefix_response(self.prefix))
        listed = [(kv.key, kv.value) for kv in resp.kvs]
        return apply_events({}, self.prefix, listed), resp.header.revision

    def _follow(self, values: dict[str, bytes], rev: int) -> None:
        """Watch from ``rev`` + 1 and apply each batch of events to ``values`` as it
        comes, on one stream until the resync deadline, until something asks for a
        listing (a compaction, a surprising response, etcd gone back in time) or the
        view stops; errors propagate. A watch renewed at the deadline missed nothing: it
        goes on from the last revision seen, after a one-key read of etcd's revision."""
        def apply(batch: WatchBatch) -> None:
            nonlocal values, rev
            values = apply_events(values, self.prefix, batch.events)
            rev = batch.revision
            assert self._token is not None
            trio.from_thread.run_sync(self._publish, values, trio_token=self._token)

        while not self._stop.is_set():
            if self.store.watch_prefix(self.prefix, rev + 1, self.resync, apply) is not None:
                return                       # compacted or surprised: list again
            if self.store.revision() < rev:
                return                       # restored from a snapshot: list again

    def _publish(self, values: dict[str, bytes]) -> None:
        self.listed.set()
        if values == self.values:
            return
        self._change(values)
        if self.keep:
            self._keep(values)

    def _change(self, values: dict[str, bytes]) -> None:
        self.values = values
        self.revision += 1
        old, self.changed = self.changed, trio.Event()
        old.set()
        if self.on_change is not None:
            self.on_change(values)

    def _keep(self, values: dict[str, bytes]) -> None:
        """``values`` into ``keep`` (a few KB, on tmpfs, on a change: written here, in the
        trio thread), replaced whole; trouble is a log line, never the view's."""
        assert self.keep is not None
        tmp = f"{self.keep}.{os.getpid()}.tmp"
        try:
            os.makedirs(os.path.dirname(self.keep), mode=0o700, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(json.dumps({k: base64.b64encode(v).decode() for k, v in values.items()})
                        .encode())
            os.replace(tmp, self.keep)
        except OSError as e:
            log.warning("could not keep the last known %s in %s: %s", self.prefix, self.keep, e)

    @staticmethod
    def last_known(path: str) -> dict[str, bytes]:
        """The values a view kept in ``path`` (``_keep``); ValueError for anything else
        (a torn, foreign or damaged file), OSError when it cannot be read."""
        with open(path, "rb") as f:
            raw = f.read(1 << 24)
        try:
            doc = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise ValueError(f"not JSON: {e}") from None
        if not isinstance(doc, dict):
            raise ValueError("not an object of keys")
        values = {}
        for k, v in doc.items():
            if not isinstance(v, str):
                raise ValueError(f"{k!r}: not base64 text")
            try:
                values[k] = base64.b64decode(v, validate=True)
            except (binascii.Error, ValueError) as e:
                raise ValueError(f"{k!r}: {e}") from None
        return values

    def _seed(self) -> None:
        """Nothing listed in time: the values ``keep`` holds, if any, as a change (etcd's
        listing replaces them when it comes)."""
        assert self.keep is not None
        try:
            values = self.last_known(self.keep)
        except FileNotFoundError:
            return
        except (OSError, ValueError) as e:
            log.warning("ignoring the last known %s in %s: %s", self.prefix, self.keep, e)
            return
        log.info("etcd did not list %s in %gs: starting from the %d keys the last daemon "
                 "knew (%s)", self.prefix, self.first_wait, len(values), self.keep)
        if not self.listed.is_set() and values != self.values:
            self._change(values)

    def _loop(self) -> None:
        """Worker thread: list, block on a watch, repeat; until stopped."""
        down = False
        while not self._stop.is_set():
            try:
                values, rev = self._list()
                if down:
                    log.info("etcd reachable again: %s resynchronised", self.prefix)
                down = False
                assert self._token is not None
                trio.from_thread.run_sync(self._publish, values, trio_token=self._token)
                self._follow(values, rev)
            except trio.RunFinishedError:
                return
            except Exception as e:          # StoreError, or an etcd3 client bug
                if not isinstance(e, StoreError):
                    log.exception("watching %s failed", self.prefix)
                if not down:
                    log.warning("etcd unreachable; keeping the last known %s (%d keys): %s",
                                self.prefix, len(self.values), e)
                down = True
                self._stop.wait(0.5)

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled; ``started`` after the first listing (or first failure)."""
        self._token = trio.lowlevel.current_trio_token()
        thread_done = trio.Event()

        async def worker() -> None:
            try:
                await trio.to_thread.run_sync(self._loop, abandon_on_cancel=True)
            finally:
                thread_done.set()

        try:
            async with trio.open_nursery() as n:
                n.start_soon(worker)
                with trio.move_on_after(self.first_wait):
                    await self.listed.wait()
                if self.seed and self.keep and not self.listed.is_set():
                    self._seed()
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._stop.set()


class Membership:
    """The cluster's nodes, as :class:`NodeRecord` s and as placement :class:`Member` s.

    ``nodes`` and ``members`` are the live records plus those still within
    ``leave_grace`` seconds of their record's disappearance (see the module docstring:
    flap damping); ``leaving`` maps such a node to the trio time its grace ends. ``epoch``
    counts changes of ``nodes``; ``changed`` is an Event replaced (set) on each one,
    for whoever recomputes placement (the node's reconcile loop)."""

    def __init__(self, store: EtcdStore, resync: float = 10.0, leave_grace: float = 0.0,
                 first_wait: float | None = None, keep: str | None = None,
                 seed: bool = False) -> None:
        """``first_wait``, ``keep``, ``seed``: as :class:`PrefixView`'s."""
        self.view = PrefixView(store, "nodes/", resync, NodeRecord.verifying(store, self._decode),
                               first_wait, keep, seed)
        self.leave_grace = leave_grace
        self.nodes: dict[str, NodeRecord] = {}
        self.members: list[Member] = []
        self.leaving: dict[str, float] = {}
        self.epoch = 0
        self.changed = trio.Event()
        self._live: dict[str, NodeRecord] = {}
        self._held: dict[str, NodeRecord] = {}          # records of the nodes in ``leaving``
        self._rearm = trio.Event()                      # ``leaving`` gained a deadline

    def _decode(self, values: dict[str, bytes]) -> None:
        live = {}
        for key, raw in values.items():
            try:
                live[key] = NodeRecord.from_json(raw)
            except (ValueError, TypeError) as e:
                log.warning("ignoring malformed node record %s: %s", key, e)
        now = trio.current_time()
        for node in sorted(set(self._live) - set(live)):
            if self.leave_grace > 0:
                self.leaving[node] = now + self.leave_grace
                self._held[node] = self._live[node]
                log.info("membership: %s's record is gone; it keeps its placement for %gs "
                         "(cluster.leave_grace)", node, self.leave_grace)
                self._rearm.set()
        for node in sorted(set(live) & set(self.leaving)):
            del self.leaving[node], self._held[node]
            log.info("membership: %s is back within its grace; placement unchanged", node)
        self._live = live
        self._apply()

    def _expire(self) -> None:
        now = trio.current_time()
        for node in [n for n, t in self.leaving.items() if t <= now]:
            del self.leaving[node], self._held[node]
        self._apply()

    def _apply(self) -> None:
        nodes = {**self._held, **self._live}
        joined = sorted(set(nodes) - set(self.nodes))
        left = sorted(set(self.nodes) - set(nodes))
        if joined or left:
            log.info("membership: %d nodes%s%s", len(nodes),
                     f"; joined {', '.join(joined)}" if joined else "",
                     f"; left {', '.join(left)}" if left else "")
        if nodes == self.nodes:
            return
        self.nodes = nodes
        self.members = sorted((r.member() for r in nodes.values()), key=lambda m: m.node)
        self.epoch += 1
        old, self.changed = self.changed, trio.Event()
        old.set()

    async def _expire_forever(self) -> None:
        while True:
            self._rearm = trio.Event()
            if self.leaving:
                with trio.move_on_at(min(self.leaving.values())):
                    await self._rearm.wait()
                self._expire()
            else:
                await self._rearm.wait()

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as n:
            n.start_soon(self._expire_forever)
            await n.start(self.view.run)
            task_status.started()
