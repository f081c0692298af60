"""A node's copy of manifest pages on its host (``cluster.page_copy``), filled from peers.

A paged manifest's pages (``manifest/pages.py``) live in ``store.pages``, which every
mount used to read: for a cluster, a shared filesystem. Here each node keeps a page
directory on its host, laid out as ``store.pages`` is (``<hh>/<SHA-256 hex>``, one zlib
stream each), so the page map (``native/manifest_pager.c``: C only, it must never need
Python) reads it unchanged, listed before ``store.pages`` (``manifest/load.py``)::

    Reconciler (a preloaded version v) ─► PageCopy.fill(v)
        root = v's store blob (signed record) ─► table pages ─► data pages
        each page missing here:  peers, rendezvous on the page hash over the live members
                                 ({"op": "page"} on the node RPC, next member on failure)
                              → this node's store.pages, if it has one: a directory,
                                 or a bucket prefix (objstore/pages.py, a GET)
        verified (inflate ≤ page size + 1, SHA-256) before write-then-rename
        data pages first, table pages LAST: a version's tables in the copy mean all of it is

    mount on the host ─► open_index(dirs = [page copy, store.pages]) ─► PageMap
        a page in neither: asked of this node on <copy>/.ask (page_ask.py), which
        fetches it as above (fetch_one) into the copy; then read from the copy

* **Trust.** A page is verified against its hash whoever sent it (``pages.inflate_page``);
  a peer can withhold a page, never change one. The directory is checked as the arena's
  is (``arena_files.private_directory``: no symbolic link on its path, ours, 0700), when
  first needed: a node that never preloads a paged manifest never makes it. The node
  holds a ``flock`` on it from then on: a second node on the host with the same
  directory is refused in one line (each sweeps what its own versions do not reference).
* **Answering peers** (:meth:`PageCopy.answer`): a page from the copy, else from this
  node's ``store.pages`` when it is a directory (never a bucket: the asker reads the
  bucket itself after its peers, and a GET would hold the reply), else ``absent``; at
  most ``PAGE_REPLY_MAX`` zlib'd bytes, base64'd in the JSON reply. Not verified on the
  way out (the asker verifies).
* **Sweep** (:meth:`PageCopy.retain`): pages no preloaded version references go
  (``pages.sweep``, the store's own sweep), once the version has been gone
  ``PAGE_COPY_GRACE`` seconds and no live mount holds it (``mounts/``): a mount
  started on it faults pages in from the copy for as long as it runs.
* **Cost.** The copy holds each page once per host, zlib'd: a version's manifest
  compressed (docs/design.md, "Paged manifests", pages from peers).
"""
from __future__ import annotations

import base64
import binascii
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import trio

from ..errors import ConfigError, KspeedfsError, ManifestCorrupt
from ..manifest.pages import (
    HASH_SIZE,
    PageDirectory,
    PageStore,
    Root,
    inflate_page,
    is_root,
    page_path,
    page_store,
    put_page,
    read_page,
    referenced,
    sweep,
    table_pages,
)
from ..manifest.store.etcd import EtcdStore
from ..tuning import PAGE_COPY_GRACE, PAGE_PEER_TRIES, PAGE_REPLY_MAX, UNREACHABLE_SKIP
from . import lifecycle
from .arena_files import exclusive_lock, private_directory
from .connections import Connections
from .membership import Membership
from .node_stats import NodeCounters
from .placement import owners
from .rpc import RpcUnavailable

log = logging.getLogger(__name__)

#: s a node waits for the copy's lock: a restarted node's predecessor may still be exiting
COPY_LOCK_WAIT = 5.0

#: a page's hash on the wire: 64 lowercase hex digits
HEX_LEN = 2 * HASH_SIZE


class PageRefused(KspeedfsError):
    """A peer's ``page`` reply failed its checks (not bytes, too big, not the page)."""


def page_request(digest: bytes) -> dict[str, Any]:
    return {"op": "page", "hash": digest.hex()}


def page_reply(data: bytes | None) -> dict[str, Any]:
    """The reply to a ``page`` request: the page file's bytes, or absent."""
    if data is None:
        return {"absent": True}
    return {"page": base64.b64encode(data).decode()}


def parse_page_reply(reply: Any, digest: bytes, length: int) -> bytes | None:
    """A peer's ``page`` reply (untrusted) → the page file's bytes (zlib), checked to
    inflate to the ``length`` bytes whose SHA-256 is ``digest``; None when the peer says
    it has none; :class:`PageRefused` for anything else."""
    if not isinstance(reply, dict):
        raise PageRefused("page reply is not an object")
    if reply.get("absent") is True and "page" not in reply:
        return None
    text = reply.get("page")
    if not isinstance(text, str):
        raise PageRefused("page reply has no page")
    if len(text) > 4 * (PAGE_REPLY_MAX // 3 + 1):
        raise PageRefused(f"page reply of {len(text)} characters (max {PAGE_REPLY_MAX} bytes)")
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise PageRefused(f"page reply is not base64 ({e})") from None
    try:
        inflate_page(data, digest, length)
    except ValueError as e:
        raise PageRefused(f"page {digest.hex()[:16]}: {e}") from None
    return data


def parse_page_hash(value: Any) -> bytes:
    """A ``page`` request's hash (untrusted) → 32 bytes; ``KspeedfsError`` otherwise."""
    if not isinstance(value, str) or len(value) != HEX_LEN:
        raise KspeedfsError(f"page: hash must be {HEX_LEN} hex digits")
    try:
        digest = bytes.fromhex(value)
    except ValueError:
        raise KspeedfsError("page: hash must be hex digits") from None
    if digest.hex() != value:
        raise KspeedfsError("page: hash must be lowercase hex")
    return digest


class PageCopy:
    """This node's page directory: filled with every page of the versions it preloads,
    from peers then ``store.pages``; answers peers' ``page`` requests; swept.

    Contract: :meth:`fill` returns only once every page of the version is in the copy,
    table pages written last (so a mount that finds a version's table pages there finds
    all of it), each page verified before it is written; it raises ``KspeedfsError``
    when a page is nowhere to be had (the reconciler retries). Runs in the trio thread;
    file I/O in worker threads, ``workers`` pages at once.

    Attributes:
        directory: the copy (``cluster.page_copy``).
        store_pages: this node's ``store.pages`` (a directory or a bucket), or None.
    """

    def __init__(self, directory: str, store_pages: str | PageStore | None, me: str, store: EtcdStore,
                 membership: Membership, connections: Connections, counters: NodeCounters,
                 workers: int) -> None:
        self.directory = directory
        self.store_pages = page_store(store_pages) if store_pages else None
        self.me = me
        self.store = store
        self.membership = membership
        self.connections = connections
        self.counters = counters
        self.workers = workers
        self._checked = False
        self._held = -1
        self.checked = trio.Event()        # the directory is made and checked (page_ask.py)
        self._roots: dict[str, Root | None] = {}      # "<ds>@<v>" filled → its root (None: whole)
        self._gone: dict[str, tuple[Root, float]] = {}  # no longer preloaded → (root, since)
        # members that failed a page request, skipped a while: our own, not Connections'
        # skip, which chunk reads obey (an older node refusing the op is not down)
        self._skip_until: dict[str, float] = {}

    @property
    def dirs(self) -> list[str | PageStore]:
        """Where this node reads pages: the copy, then store.pages."""
        return [self.directory] + ([self.store_pages] if self.store_pages else [])

    @property
    def answers_from(self) -> list[PageStore]:
        """Where a peer's ``page`` request is answered from: the copy, then a *directory*
        store.pages. Not a bucket: the asker reads the bucket itself once its peers say
        absent, and a GET inside the RPC would hold the reply for a round trip."""
        here: list[PageStore] = [PageDirectory(self.directory)]
        if isinstance(self.store_pages, PageDirectory):
            here.append(self.store_pages)
        return here

    def _check(self) -> None:
        """Make and check the directory, and hold it: one node per copy, because a node
        sweeps what its own versions do not reference (and binds the ask socket)."""
        if self._checked:
            return
        fd = private_directory(self.directory, key="cluster.page_copy")
        if not exclusive_lock(fd, COPY_LOCK_WAIT):
            os.close(fd)
            raise ConfigError(f"cluster.page_copy: {self.directory} is the page copy of "
                              "another node running on this host; give each node its own")
        self._held = fd                  # the flock lasts as long as this process
        self._checked = True

    # -- filling ------------------------------------------------------------------------------

    async def fill(self, name: str, version: int) -> None:
        """Every page of ``name`` v``version`` in the copy (nothing to do for a whole
        manifest); once per version for this process."""
        tag = f"{name}@{version}"
        if tag in self._roots:
            return
        blob = await trio.to_thread.run_sync(self.store.manifest, name, version)
        if not is_root(blob):
            self._roots[tag] = None
            return
        root = Root.parse(blob)
        await trio.to_thread.run_sync(self._check)
        self.checked.set()
        t0, before = time.monotonic(), (self.counters.pages_from_peers,
                                        self.counters.pages_from_store)
        tables = await self._tables(root)
        hashes = b"".join(page for _, page, _ in tables)
        wanted = [(hashes[i * HASH_SIZE:(i + 1) * HASH_SIZE], root.page_len(i))
                  for i in range(root.pages)]
        await self._fetch_all(await trio.to_thread.run_sync(self._missing, wanted))
        for digest, _, data in tables:                   # last: the version is complete
            if data is not None:
                await trio.to_thread.run_sync(put_page, self.directory, digest, data)
        self._roots[tag] = root
        self._gone.pop(tag, None)
        log.info("%s: manifest pages copied to %s: %d pages, %d from peers, %d from "
                 "store.pages, in %.1fs", tag, self.directory, root.pages + len(root.tables),
                 self.counters.pages_from_peers - before[0],
                 self.counters.pages_from_store - before[1], time.monotonic() - t0)

    async def _tables(self, root: Root) -> list[tuple[bytes, bytes, bytes | None]]:
        """(digest, page, its file's bytes or None when the copy has it) of each table
        page of ``root``, verified."""
        out: list[tuple[bytes, bytes, bytes | None]] = []
        for digest, n in table_pages(root):
            try:
                page = await trio.to_thread.run_sync(read_page, [self.directory], digest, n)
                out.append((digest, page, None))
            except ManifestCorrupt:
                data = await self._get(digest, n)
                out.append((digest, inflate_page(data, digest, n), data))
        return out

    def _missing(self, wanted: list[tuple[bytes, int]]) -> list[tuple[bytes, int]]:
        return [(d, n) for d, n in dict(wanted).items()
                if not os.path.exists(page_path(self.directory, d))]

    async def _fetch_all(self, missing: list[tuple[bytes, int]]) -> None:
        todo = iter(missing)
        failed: list[KspeedfsError] = []

        async def worker() -> None:
            for digest, n in todo:
                try:
                    await self.fetch_one(digest, n)
                except KspeedfsError as e:
                    failed.append(e)

        async with trio.open_nursery() as nursery:
            for _ in range(self.workers):
                nursery.start_soon(worker)
        if failed:
            raise ManifestCorrupt(f"{len(failed)} of {len(missing)} manifest pages could not "
                                  f"be copied; the first: {failed[0]}")

    async def _get(self, digest: bytes, length: int) -> bytes:
        """One page's verified file bytes: from peers, else this node's store.pages."""
        members = [m for m in self.membership.members if m.node != self.me]
        order = owners(digest, members, len(members))
        if self.store_pages:
            order = order[:PAGE_PEER_TRIES]
        why, now = "no peer has it", time.monotonic()
        for node in order:
            rec = self.membership.nodes.get(node)
            if rec is None or self._skip_until.get(node, 0.0) > now:
                continue                 # (a dead node in its leave grace: not per page)
            try:
                reply = await self.connections.rpc(rec).request(page_request(digest))
                data = parse_page_reply(reply, digest, length)
            except PageRefused as e:
                self.counters.pages_refused += 1
                log.warning("page from %s refused: %s", node, e)
                continue
            except RpcUnavailable as e:
                why = str(e)
                self._skip_until[node] = time.monotonic() + UNREACHABLE_SKIP
                continue
            if data is not None:
                self.counters.pages_from_peers += 1
                return data
        if self.store_pages:
            data = await trio.to_thread.run_sync(self._from_store, digest, length)
            self.counters.pages_from_store += 1
            return data
        raise ManifestCorrupt(f"manifest page {digest.hex()}: {why}, and this node has no "
                              "store.pages")

    def _from_store(self, digest: bytes, length: int) -> bytes:
        """One page's verified bytes from store.pages (a directory or a bucket)."""
        assert self.store_pages is not None
        where = self.store_pages.where
        try:
            data = self.store_pages.get(digest, PAGE_REPLY_MAX << 2)
        except OSError as e:
            raise ManifestCorrupt(f"manifest page {digest.hex()} unreadable in {where}: {e}") from None
        if data is None:
            raise ManifestCorrupt(f"manifest page {digest.hex()} is not in {where}")
        try:
            inflate_page(data, digest, length)
        except ValueError as e:
            raise ManifestCorrupt(f"manifest page {digest.hex()} in {where}: {e}") from None
        return data

    async def fetch_one(self, digest: bytes, length: int) -> None:
        """Page ``digest`` (``length`` bytes inflated) into the copy, unless a valid copy
        is there (a damaged one is replaced: a mount's page map that asks found it bad).
        ``KspeedfsError`` when nobody has it."""
        try:
            await trio.to_thread.run_sync(read_page, [self.directory], digest, length)
            return
        except ManifestCorrupt:
            pass
        data = await self._get(digest, length)
        await trio.to_thread.run_sync(put_page, self.directory, digest, data)

    # -- answering peers ----------------------------------------------------------------------

    async def answer(self, value: Any) -> dict[str, Any]:
        """The reply to ``{"op": "page", "hash": value}``."""
        digest = parse_page_hash(value)
        data = await trio.to_thread.run_sync(self._local, digest)
        if data is not None:
            self.counters.pages_served += 1
        return page_reply(data)

    def _local(self, digest: bytes) -> bytes | None:
        for d in self.answers_from:
            try:
                data = d.get(digest, PAGE_REPLY_MAX)
            except OSError:
                continue
            if data is not None:
                return data
        return None

    # -- sweeping -----------------------------------------------------------------------------

    async def retain(self, tags: Sequence[str], grace: float = PAGE_COPY_GRACE) -> int:
        """Keep the pages of the versions ``tags`` names ("<ds>@<v>"), of those gone
        less than ``grace`` seconds and of those a live mount holds (``mounts/``);
        remove the others' from the copy (``pages.sweep``, with the same grace for
        files). How many pages went."""
        now = time.monotonic()
        for tag in [t for t in self._roots if t not in tags]:
            root = self._roots.pop(tag)
            if root is not None:
                self._gone[tag] = (root, now)
        expired = [t for t, (_, since) in self._gone.items() if now - since >= grace]
        if not expired:
            return 0
        try:
            held = await trio.to_thread.run_sync(lifecycle.mounts, self.store)
        except KspeedfsError as e:
            log.warning("page copy: not swept, the mounts are unknown: %s", e)
            return 0
        for tag in expired:
            root, _ = self._gone.pop(tag)
            if held.get(tag):                 # a mount reads it still: another grace
                self._gone[tag] = (root, now)
        expired = [t for t in expired if t not in self._gone]
        if not expired:
            return 0
        keep_roots = [r for r in self._roots.values() if r is not None]
        keep_roots += [r for r, _ in self._gone.values()]
        gone = await trio.to_thread.run_sync(self._sweep, keep_roots, grace)
        log.info("page copy: %d pages of %s removed", gone, ", ".join(expired))
        return gone

    def _sweep(self, roots: list[Root], grace: float) -> int:
        keep: set[bytes] = set()
        for root in roots:
            keep |= referenced(root, self.dirs)
        return sweep(self.directory, keep, grace)
