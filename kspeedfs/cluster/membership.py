"""Membership in etcd: a node's leased record, and everyone's live view of the cluster.

Keys (``P`` = ``store.etcd_prefix``)::

    P nodes/<node>                   NodeRecord JSON, attached to the node's lease
    P preload/<dataset>              {"version": N}: the cluster should hold this version
    P progress/<dataset>@<N>/<node>  a node's preload progress (also on its lease)
    P stats/<node>                   a node's statistics for ``kspeedfs status`` (lease)

A node puts its record with a lease of ``cluster.lease_ttl`` seconds and refreshes it
every third of that; when the node dies the lease expires and etcd deletes every key
on it, which is how the others learn (no separate failure detector for *membership*:
vRDMA heartbeats already detect a dead peer in ~50 ms for the read path, the lease
decides when its chunks are re-replicated). A lease lost anyway (etcd restored from a
snapshot, a long partition) is re-granted and the keys put again.

Views (:class:`PrefixView`) watch a prefix: list it (remembering the revision), then
block on a watch from the next revision; any event, or every ``resync`` seconds, lists
again. Readers consult the view's in-memory copy; nothing on the read path talks to
etcd. If etcd is unreachable the view keeps the last membership it saw and says so in
the log once; it catches up when etcd is back.
"""
from __future__ import annotations

import json
import logging
import socket
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import trio

from ..errors import StoreError
from ..manifest.store.etcd import EtcdStore
from .placement import Member

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeRecord:
    """What a node publishes about itself (``P nodes/<node>``)."""

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

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "NodeRecord":
        d = json.loads(raw)
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})

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

    def _grant(self) -> None:
        lease = self.store.call(lambda c: c.lease(self.ttl))
        self.lease_id = lease.id
        with self._lock:
            keys = dict(self._keys)
        for k, v in keys.items():
            self.store.call(lambda c, k=k, v=v: c.put(k, v, lease=self.lease_id))
        log.info("etcd lease %x granted (ttl %ds); %d keys attached", self.lease_id, self.ttl, len(keys))

    def put(self, key: str, value: bytes) -> None:
        """Blocking: put ``key`` on the lease (and remember it for a re-grant)."""
        with self._lock:
            self._keys[key] = value
        if self.lease_id is None:
            self._grant()
        else:
            self.store.call(lambda c: c.put(key, value, lease=self.lease_id))

    def _refresh(self) -> None:
        if self.lease_id is None:
            self._grant()
            return
        lease_id = self.lease_id
        responses = self.store.call(lambda c: list(c.refresh_lease(lease_id)))
        if not responses or responses[0].TTL <= 0:
            log.warning("etcd lease %x expired; registering again", lease_id)
            self._grant()

    async def run(self) -> None:
        """Refresh every ttl/3; etcd outages are logged and ridden out."""
        down = False
        while True:
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
            await trio.sleep(self.ttl / 3)

    def revoke(self) -> None:
        """Blocking: leave the cluster now (clean shutdown) instead of after the TTL."""
        if self.lease_id is not None:
            lease_id, self.lease_id = self.lease_id, None
            try:
                self.store.call(lambda c: c.revoke_lease(lease_id))
            except StoreError as e:
                log.warning("cannot revoke lease %x: %s", lease_id, e)


def _watch_once(client: Any, prefix: str, timeout: float, start_revision: int) -> None:
    """Block until a key under ``prefix`` changes after ``start_revision`` or ``timeout``."""
    import etcd3.exceptions

    try:
        client.watch_prefix_once(prefix, timeout=timeout, start_revision=start_revision)
    except etcd3.exceptions.WatchTimedOut:
        pass
    except AttributeError as e:
        # etcd3 0.12 hands a failed watch stream (etcd restarting) to watch_once as if it
        # were a response; treat it like the connection failure it is.
        raise etcd3.exceptions.ConnectionFailedError(f"watch stream failed: {e}") from e


class PrefixView:
    """An in-memory copy of every key under a prefix, kept current by a watch.

    ``values`` maps the key's suffix to its raw value; ``revision`` counts changes seen;
    ``changed`` is an Event replaced (set) on every change. ``on_change`` runs in the
    trio thread after each change."""

    def __init__(self, store: EtcdStore, prefix: str, resync: float = 10.0,
                 on_change: Callable[[dict[str, bytes]], None] | None = None) -> None:
        self.store = store
        self.prefix = store.prefix + prefix
        self.resync = resync
        self.on_change = on_change
        self.values: dict[str, bytes] = {}
        self.revision = 0
        self.changed = trio.Event()
        self.listed = trio.Event()          # set after the first successful listing
        self._stop = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None

    def _list(self) -> tuple[dict[str, bytes], int]:
        resp = self.store.call(lambda c: c.get_prefix_response(self.prefix))
        n = len(self.prefix)
        return {kv.key.decode()[n:]: kv.value for kv in resp.kvs}, resp.header.revision

    def _publish(self, values: dict[str, bytes]) -> None:
        self.listed.set()
        if values == self.values:
            return
        self.values = values
        self.revision += 1
        old, self.changed = self.changed, trio.Event()
        old.set()
        if self.on_change is not None:
            self.on_change(values)

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
                self.store.call(lambda c: _watch_once(c, self.prefix, self.resync, rev + 1))
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
                with trio.move_on_after(self.store.timeout + 1):
                    await self.listed.wait()
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._stop.set()


class Membership:
    """The live nodes, as :class:`NodeRecord` s and as placement :class:`Member` s."""

    def __init__(self, store: EtcdStore, resync: float = 10.0) -> None:
        self.view = PrefixView(store, "nodes/", resync, self._decode)
        self.nodes: dict[str, NodeRecord] = {}
        self.members: list[Member] = []
        self.epoch = 0

    def _decode(self, values: dict[str, bytes]) -> None:
        nodes = {}
        for key, raw in values.items():
            try:
                nodes[key] = NodeRecord.from_json(raw)
            except (ValueError, TypeError) as e:
                log.warning("ignoring malformed node record %s: %s", key, e)
        joined = sorted(set(nodes) - set(self.nodes))
        left = sorted(set(self.nodes) - set(nodes))
        if joined or left:
            log.info("membership: %d nodes%s%s", len(nodes),
                     f"; joined {', '.join(joined)}" if joined else "",
                     f"; left {', '.join(left)}" if left else "")
        self.nodes = nodes
        self.members = sorted((r.member() for r in nodes.values()), key=lambda m: m.node)
        self.epoch += 1

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        await self.view.run(task_status=task_status)
