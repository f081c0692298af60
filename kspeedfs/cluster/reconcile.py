"""A node's loops over ``preload/``: reconcile its share, release unheld preloads.

    Reconciler       preload, re-replication, rejoin and unload as one loop (``node.py``'s
                     docstring: why one); the rank of each chunk the arena evicts by;
                     ``progress/<ds>@<v>/<node>`` for ``kspeedfs preload``
    release_forever  the first live node releases an ``--unload-on-exit`` preload no mount
                     holds any more (``lifecycle.py``: release on last mount)

Both run in the node's nursery (``node.serve``); the chunks themselves are loaded,
held and dropped by :class:`~kspeedfs.cluster.share.Share`.
"""
from __future__ import annotations

import json
import logging
import time

import trio

from ..config import Config
from ..errors import ChunkUnavailable, KspeedfsError, SourceChanged
from ..manifest.index import ManifestIndex
from ..manifest.store.etcd import EtcdStore
from ..tuning import RELEASE_GRACE_TTLS
from . import lifecycle
from .lifecycle import PreloadRequest
from .membership import Membership, PrefixView, Registration
from .node_stats import NodeCounters
from .page_copy import PageCopy
from .placement import Member
from .share import Dataset, Share

log = logging.getLogger(__name__)


class Reconciler:
    """Makes the arena hold this node's owned chunks of every preloaded dataset version.

    :meth:`run` reconciles whenever ``preload/`` or the membership changes (and 2 s
    after a failed pass): for every version ``preload`` names, its manifest's pages are
    copied to the host first when it is paged (``pages``: ``page_copy.py``; the copies
    of versions no longer named are swept), then the chunks placement gives
    this node under the current membership are loaded if missing, highest priority
    first, from another replica if one has it, else the source; versions no longer named
    have their chunks dropped (except chunks a named version shares). A chunk the source
    cannot give fails its pass, not the node: the next pass retries it. Owns ``progress``
    (``"<ds>@<v>"`` → owned/cached/from_source/from_peer/..., published on the node's
    lease, shown by ``kspeedfs status``) and the rank table behind :meth:`rank`. Trio
    thread only; placement of a whole dataset is computed in a worker thread."""

    def __init__(self, cfg: Config, name: str, store: EtcdStore, share: Share,
                 membership: Membership, preload: PrefixView, registration: Registration,
                 counters: NodeCounters, pages: PageCopy | None = None) -> None:
        self.cfg = cfg
        self.pages = pages
        self.name = name
        self.store = store
        self.share = share
        self.membership = membership
        self.preload = preload
        self.registration = registration
        self.counters = counters
        self.progress: dict[str, dict[str, int]] = {}
        self._last_members: list[str] = []
        self._rank: dict[bytes, int] = {}    # my share: key -> priority of its dataset
        self._group: dict[bytes, str] = {}   # my share: key -> its granted dataset (grant.py)
        self._held: dict[str, int] = {}      # dataset -> version reconcile last filled

    def rank(self, key: bytes) -> int:
        """The arena's eviction class of ``key``: the highest priority of the preloaded
        datasets in my share that hold it; -1 outside my share (evicted first)."""
        return self._rank.get(key, -1)

    def group(self, key: bytes) -> str | None:
        """The arena's group of ``key`` (``arena.py``, "Segments and groups"): the
        preloaded dataset with a ``cluster.host_readers`` entry whose share here holds
        it, the highest priority one when several do (the first by name on a tie);
        None when none does (never granted)."""
        return self._group.get(key)

    async def run(self) -> None:
        while True:
            preload_changed = self.preload.changed
            members_changed = self.membership.changed
            try:
                await self.reconcile()
            except KspeedfsError as e:
                log.error("reconcile: %s; retrying in 2 s", e)
                with trio.move_on_after(2):
                    await preload_changed.wait()
                continue
            async with trio.open_nursery() as n:
                async def wait(ev: trio.Event) -> None:
                    await ev.wait()
                    n.cancel_scope.cancel()
                n.start_soon(wait, preload_changed)
                n.start_soon(wait, members_changed)
            await trio.sleep(0.2)                    # debounce a burst of changes

    async def reconcile(self) -> None:
        wanted: dict[str, PreloadRequest] = {}
        for name, raw in self.preload.values.items():
            try:
                wanted[name] = PreloadRequest.from_json(raw)
            except ValueError as e:
                log.warning("ignoring malformed preload request for %s: %s", name, e)
        members = [m.node for m in self.membership.members]
        rereplicating = bool(set(self._last_members) - set(members))
        if members != self._last_members and self._last_members:
            log.info("membership changed (%s → %s): re-checking my share",
                     ",".join(self._last_members), ",".join(members))
        self._last_members = members
        if self.name not in members:
            return                                   # not registered (yet): own nothing
        rank: dict[bytes, int] = {}
        group: dict[bytes, str] = {}
        datasets, shares = {}, {}
        member_list = list(self.membership.members)     # one placement for the whole pass
        # by priority, then name: the first dataset to claim a key for its group keeps it
        for name, req in sorted(wanted.items(), key=lambda nr: (-nr[1].priority, nr[0])):
            if self.pages is not None:               # a paged manifest: its pages here first
                await self.pages.fill(name, req.version)
            ds = datasets[name] = await self.share.dataset(name, req.version)
            ix = ds.index
            mine = shares[name] = await trio.to_thread.run_sync(self._mine, ix, member_list)
            granted = name in self.cfg.cluster.host_readers
            for k in mine:
                key = ix.chunk_digest(k)
                rank[key] = max(rank.get(key, req.priority), req.priority)
                if granted:
                    group.setdefault(key, name)
        self._rank = rank
        self._group = group
        if group:                                    # adopted chunks: their datasets' again
            moved = self.share.arena.regroup()
            if moved:
                log.info("arena: %d segment(s) of adopted chunks given back to their datasets",
                         moved)
        self._drop_unloaded({n: r.version for n, r in wanted.items()})
        if self.pages is not None:
            await self.pages.retain([f"{n}@{r.version}" for n, r in wanted.items()])
        # highest priority first: when memory is short, what matters most is loaded first
        for name, req in sorted(wanted.items(), key=lambda nr: (-nr[1].priority, nr[0])):
            await self._fill(datasets[name], shares[name], rereplicating)
            self._held[name] = req.version

    def _mine(self, ix: ManifestIndex, members: list[Member]) -> list[int]:
        """The chunks of ``ix`` placement gives this node under ``members``. In a worker
        thread: a hash per chunk and member, seconds for a million chunks, which the
        trio thread (RPCs, leases) must not spend."""
        return [k for k in range(ix.chunks) if self.share.owns(ix.chunk_digest(k), members)]

    def _drop_unloaded(self, wanted: dict[str, int]) -> None:
        """Forget the chunks of every version reconcile filled before and no preload
        names now (``kspeedfs unload``/``rm``, or a new version preloaded), except
        chunks a wanted version shares; from the arena and the SSD tier."""
        for name, version in list(self._held.items()):
            if wanted.get(name) == version:
                continue
            del self._held[name]
            tag = f"{name}@{version}"
            self.progress.pop(tag, None)
            self.registration.forget(f"{self.store.prefix}progress/{tag}/{self.name}")
            ds = self.share.forget(name, version)
            if ds is None:
                continue
            chunks = nbytes = 0
            for k in range(ds.index.chunks):
                key = ds.index.chunk_digest(k)
                if key not in self._rank and self.share.drop(key):  # (else a wanted version has it)
                    chunks, nbytes = chunks + 1, nbytes + ds.index.chunk_len[k]
            self.counters.unloaded += chunks
            log.info("%s unloaded: dropped %d chunks (%d bytes) from the arena and SSD tier",
                     tag, chunks, nbytes)

    async def _fill(self, ds: Dataset, mine: list[int], rereplicating: bool) -> None:
        """Load the chunks of ``ds`` this node owns (``mine``) that it does not hold."""
        ix = ds.index
        missing = [k for k in mine if not self.share.has(ix.chunk_digest(k))]
        tag = f"{ds.info.name}@{ds.info.version}"
        prog = self.progress[tag] = {"owned": len(mine), "cached": len(mine) - len(missing),
                                     "owned_bytes": sum(ix.chunk_len[k] for k in mine),
                                     "from_source": 0, "from_peer": 0, "refused": 0}
        if not missing:
            await self._publish_progress(tag, [ix.chunk_digest(k) for k in mine])
            return
        log.info("%s: %d of my %d chunks missing; loading (%s)", tag, len(missing), len(mine),
                 "re-replication" if rereplicating else "preload")
        t0 = time.monotonic()
        todo = iter(missing)
        last_pub = 0.0
        failed: list[KspeedfsError] = []

        async def worker() -> None:
            nonlocal last_pub
            for k in todo:
                # a chunk the source cannot give now (an object store timing out) is one
                # failure, not the node's: the pass goes on, and reconcile retries the rest
                try:
                    where = await self.share.load_chunk(ds, k)
                except (ChunkUnavailable, SourceChanged) as e:
                    failed.append(e)
                    continue
                if not self.share.has(ix.chunk_digest(k)):
                    prog["refused"] += 1             # Arena.put refused it (``_room``)
                    continue
                prog["cached"] += 1
                if where == "source":
                    prog["from_source"] += 1
                elif where == "peer":
                    prog["from_peer"] += 1
                if rereplicating:
                    self.counters.rereplicated += 1
                if time.monotonic() - last_pub > 1.0:
                    last_pub = time.monotonic()
                    await self._publish_progress(tag)

        async with trio.open_nursery() as n:
            for _ in range(self.cfg.cluster.preload_workers):
                n.start_soon(worker)
        await self._publish_progress(tag, [ix.chunk_digest(k) for k in mine])
        if failed:
            raise ChunkUnavailable(f"{tag}: {len(failed)} of my {len(missing)} missing chunks "
                                   f"could not be loaded; the first: {failed[0]}")
        dt = time.monotonic() - t0
        if prog["refused"]:
            log.warning("%s: %d of my %d chunks are not held here: room for them would evict "
                        "chunks of a dataset of higher or equal priority (preloaded with "
                        "--force? a lost peer's share?), or both their index buckets are full; "
                        "their other replicas, or the source, serve them", tag, prog["refused"],
                        len(mine))
        else:
            log.info("%s: my share is cached: %d chunks (%d from peers, %d from the source) "
                     "in %.1fs", tag, len(mine), prog["from_peer"], prog["from_source"], dt)

    async def _publish_progress(self, tag: str, mine: list[bytes] | None = None) -> None:
        """Publish ``progress/<tag>/<node>``; with ``mine`` (the keys of my share, once a
        fill pass ended) also how many of them are in memory and on the SSD tier."""
        key = f"{self.store.prefix}progress/{tag}/{self.name}"
        prog = self.progress[tag]
        if mine is not None:
            prog["in_memory"], prog["on_disk"] = self.share.held(mine)
        value = json.dumps(prog).encode()
        try:
            await trio.to_thread.run_sync(self.registration.put, key, value)
        except KspeedfsError as e:
            log.warning("cannot publish progress: %s", e)


async def release_forever(store: EtcdStore, name: str, membership: Membership,
                          preload: PrefixView, lease_ttl: float) -> None:
    """The first live node releases an ``--unload-on-exit`` preload once no mount has
    held it for ``RELEASE_GRACE_TTLS`` lease TTLs (a crashed mount's hold went with
    its lease; a supervisor's resumed daemon holds it again well within that). ``name``:
    this node's."""
    grace = RELEASE_GRACE_TTLS * lease_ttl
    unheld: dict[str, float] = {}            # dataset -> when first seen with no hold
    while True:
        await trio.sleep(max(1.0, lease_ttl / 2))
        members = [m.node for m in membership.members]
        if not members or min(members) != name:
            unheld.clear()
            continue
        for ds, raw in list(preload.values.items()):
            try:
                req = PreloadRequest.from_json(raw)
                if req.release != "last-mount":
                    continue
                held = await trio.to_thread.run_sync(lifecycle.mounts, store, ds)
                if held.get(f"{ds}@{req.version}"):
                    unheld.pop(ds, None)
                    continue
                since = unheld.setdefault(ds, time.monotonic())
                if time.monotonic() - since >= grace:
                    await trio.to_thread.run_sync(lifecycle.release_if_unheld, store, ds, grace)
                    unheld.pop(ds, None)
            except ValueError:
                continue
            except KspeedfsError as e:
                log.warning("cannot check the mounts of %s: %s", ds, e)
