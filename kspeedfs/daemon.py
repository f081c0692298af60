"""The mount daemon's composition root: every resource, in order, with its teardown.

    store → DatasetInfo → manifest blob → ManifestIndex      (once; never again)
    Origin (source dir) · MemoryCache · DiskCache?        (compose.py: the library's too)
    nursery ─┬─ Reader (loads + prefetch run here)
             ├─ the request loop, one of two engines (``fuse.engine``):
             │    native: C threads on /dev/fuse answer metadata and memory-tier hits,
             │            NativeSession.serve answers their misses (fuse/native.py)
             │    pyfuse3: pyfuse3.main, every request in this thread (fuse/operations.py)
             ├─ signals: SIGTERM/SIGINT → unmount (pyfuse3.terminate / session.terminate)
             ├─ metrics exporter (only with metrics.listen: metrics.py)
             ├─ control socket + record: /run/kspeedfs/mounts/<name>.sock and .mount
             │        (handovers, counters; the registry of local mounts: fuse/registry.py)
             ├─ hold: mounts/<ds>@<v>/<host>:<pid> on this mount's lease, with its read
             │        counters (cluster mounts: cluster/lifecycle.py); on exit the
             │        --unload-on-exit preload is released if no other mount holds it
             └─ after mount: sysfs knobs, READY=1, ready()

``serve`` returns when the filesystem is unmounted (``fusermount3 -u``,
``kspeedfs umount``) or terminated by a signal; ``pyfuse3.close`` then unmounts if
still mounted. Everything that can fail for a user reason (unknown dataset, store
unreachable, source missing, bad mountpoint) fails *before* the mount is made, so a
failed ``kspeedfs mount`` leaves nothing half-mounted.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import pyfuse3
import trio

from . import compose
from . import mountpoint as mp
from .cluster.lifecycle import MountRecord
from .config import Config, secret_environment
from .errors import ManifestCorrupt, MountError
from .fuse import tuning
from .fuse.operations import Operations
from .fuse.pagecache import PageCache
from .manifest import sealed
from .manifest.index import ManifestIndex
from .manifest.load import open_on_host
from .manifest.store import identity
from .manifest.store.base import DatasetInfo
from .reader import Reader

if TYPE_CHECKING:
    from .cluster.fetch import Peers
    from .fuse.native import NativeSession
    from .fuse.registry import LocalMount
    from .manifest.store.etcd import EtcdStore

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class MountRequest:
    dataset: str
    mountpoint: str
    version: int | None = None
    source: str | None = None        # override the source recorded at import
    nonempty: bool = False
    upgrade: bool = False            # take the live mount over from its daemon (fuse/upgrade.py)
    resume: str | None = None        # take it over from its supervisor (fuse/supervisor.py)
    supervise: bool = False          # leave a supervisor behind (daemonized native mounts)
    unload_on_exit: bool = False     # release the preload when the last mount of it goes
    argv: tuple[str, ...] = ()       # the kspeedfs arguments that mount it (for the supervisor)
    logfile: str = ""
    manifest_fd: int | None = None   # a resume: the supervisor's sealed copy (manifest/sealed.py)


def load_dataset(cfg: Config, req: MountRequest) -> tuple[DatasetInfo, bytes, ManifestIndex]:
    """Blocking: the only store access of a mount's lifetime (none on a resume with the
    supervisor's sealed copy of the manifest, unless that copy fails its checks). The
    copy's fd stays open: ``serve`` keeps it for a supervisor it may start. A paged
    manifest's pages come from the host's node's copy, then ``store.pages``
    (``manifest/load.py``: with no ``store.pages``, the mount waits for the node's copy
    to hold the version, then fails with one line)."""
    info = blob = None
    if req.manifest_fd is not None:
        try:
            info, blob = sealed.unseal(req.manifest_fd, req.dataset, req.version)
            log.info("resume: the manifest from the supervisor's sealed copy")
        except ManifestCorrupt as e:
            log.warning("resume: %s; loading it from the store", e)
    if info is None or blob is None:
        info, blob = compose.fetch_manifest(cfg, req.dataset, req.version)
    return info, blob, open_on_host(cfg, blob, info)


async def _served_version(req: MountRequest, path: str) -> MountRequest:
    """An upgrade that names no version takes over the one ``path`` serves (the
    connection's inodes are that version's): asking for the current one, an upgrade after
    the dataset was imported again was refused, ``systemctl reload`` of the unit too.
    A version asked for (``--version``) is checked by the takeover as before."""
    from .fuse import upgrade as handover

    if not req.upgrade or req.version is not None:
        return req
    served = await handover.served(path)
    if served is None or served[0] != req.dataset:
        return req                  # the takeover says what is wrong
    return replace(req, version=served[1])


def _systemd_notify(state: str) -> None:
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        s.sendall(state.encode())


async def _on_signals(terminate: Callable[[], None]) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            log.info("%s: unmounting", signal.Signals(signum).name)
            terminate()
            return


def choose_engine(cfg: Config) -> str:
    """``fuse.engine``, or pyfuse3 where the native engine cannot mount (said once)."""
    if cfg.fuse.engine != "native":
        return cfg.fuse.engine
    from .fuse import native

    why = native.unavailable()
    if why:
        log.warning("fuse.engine native: %s; serving with pyfuse3", why)
        return "pyfuse3"
    return "native"


_HELD_COUNTERS = ("reads", "read_bytes", "memory_hits", "disk_hits", "peer_hits", "source_loads",
                  "source_extents", "source_blocks")


def _read_counters(reader: Reader) -> dict[str, int]:
    s = reader.statistics()
    return {name: int(getattr(s, name)) for name in _HELD_COUNTERS}


async def _hold(store: EtcdStore, record: MountRecord, ttl: int,
                counters: Callable[[], dict[str, int]], handed_over: Callable[[], bool],
                period: float = 5.0) -> None:
    """Hold ``record``'s version for this mount's life: its ``mounts/`` key on a lease
    of its own, the read counters refreshed every ``period`` s (``kspeedfs status``
    shows hit ratios from them). On the way out: the lease is revoked (the key goes) and,
    with ``--unload-on-exit``, the preload released if no other mount holds it; not
    after a handover (the new daemon holds it now). Never fails the mount: etcd
    trouble is logged."""
    from dataclasses import replace

    from .cluster import lifecycle
    from .cluster.membership import Registration
    from .errors import StoreError

    reg = Registration(store, ttl)
    key = record.key(store.prefix)
    try:
        async with trio.open_nursery() as n:
            n.start_soon(reg.run)
            while True:
                try:
                    await trio.to_thread.run_sync(
                        reg.put, key, replace(record, reads=counters()).to_json())
                except StoreError as e:
                    log.warning("cannot publish this mount's hold %s: %s", key, e)
                await trio.sleep(period)
    finally:
        with trio.CancelScope(shield=True):
            try:
                await trio.to_thread.run_sync(reg.revoke)
                if record.unload_on_exit and not handed_over():
                    await trio.to_thread.run_sync(lifecycle.release_if_unheld, store,
                                                  record.dataset, 0.0)
            except StoreError as e:
                log.warning("leaving: %s (the nodes release the preload after its grace)", e)


async def _watch_pages(index: ManifestIndex, info: DatasetInfo) -> None:
    """Say once, as an error, that a manifest page could not be loaded: from then on the
    mount answers EIO (``fuse/boundary.py``, and the native engine's C answers), which
    requests C answers alone would never log."""
    pages = index.pages
    assert pages is not None
    while not pages.failure:
        await trio.sleep(1.0)
    log.error("%s v%d: answering EIO from now on: %s", info.name, info.version, pages.failure)


async def _export_metrics(cfg: Config, ops: Operations, peers: Peers | None,
                          store: EtcdStore | None, path: str) -> None:
    """Serve this mount's metrics (``metrics.py``) at ``metrics.listen`` until cancelled."""
    from . import metrics

    def snapshot() -> dict[str, object]:
        return {"read": ops.reader.statistics(), "peers": peers.statistics() if peers else None,
                "ops": ops.op_rows(),
                "bounds": ops.op_stats.BOUNDS,
                "members": len(peers.membership.nodes) if peers else None,
                "links": peers.links() if peers else None,
                "etcd_reachable": store.reachable if store is not None else None,
                "engine": ops.transport_stats()}

    labels = {"dataset": ops.info.name, "version": str(ops.info.version), "mountpoint": path}
    with metrics.serve("metrics.listen", cfg.metrics.listen, snapshot, metrics.mount_families,
                       labels):
        await trio.sleep_forever()


async def serve(cfg: Config, req: MountRequest, ready: Callable[[str], None] | None = None) -> None:
    if req.upgrade or req.resume:
        path = os.path.abspath(req.mountpoint)
        if not mp.is_mounted(path):
            raise MountError(f"--upgrade: {path} is not mounted")
        req = await _served_version(req, path)
    else:
        path = mp.prepare(req.mountpoint, req.nonempty)
    info, blob, index = await trio.to_thread.run_sync(load_dataset, cfg, req)
    log.info("dataset %s v%d: %d entries, %d bytes, %d chunks of %d; index %d bytes",
             info.name, info.version, info.entries, info.bytes, info.chunks, info.chunk_size,
             index.nbytes)
    tiers = compose.local_tiers(cfg, info, index, req.source)
    memory, disk = tiers.memory, tiers.disk

    engine = choose_engine(cfg)
    if (req.upgrade or req.resume) and engine != "native":
        raise MountError("--upgrade needs the native FUSE engine (fuse.engine=native, root)")
    from .fuse.registry import LocalMount
    from .fuse.upgrade import members_path
    keep = members_path(path) if engine == "native" else None   # only those are taken over
    record = LocalMount.of_this_process(path, info.name, info.version, identity(cfg.store), engine)
    async with compose.cluster(cfg, index, bool(req.resume), keep,
                        bool(req.upgrade or req.resume)) as (peers, store), \
            trio.open_nursery() as nursery:
        session: NativeSession | None = None
        pages = None
        if cfg.fuse.push_pages:
            pages = PageCache(index, store=pyfuse3.notify_store if engine == "pyfuse3"
                              else lambda *a: session.notify_store(*a))   # type: ignore[union-attr]
        reader = compose.new_reader(cfg, info, index, tiers, nursery, peers,
                                    push=pages.push if pages else None)
        ops = Operations(index, reader, info, cfg.fuse, slow_op=cfg.log.slow_op)
        if engine == "native":
            from .fuse.native import NativeSession

            session = NativeSession(path, ops, memory, index, info, cfg.fuse, nonempty=req.nonempty,
                                    record=record)
            reader.served_elsewhere = session.served
        if store is not None:                     # held from now: a --preload is not released
            hold = MountRecord(info.name, info.version, os.uname().nodename, path,
                               os.getpid(), unload_on_exit=req.unload_on_exit)
            handed_over = lambda: session is not None and session.handed_over  # noqa: E731
            nursery.start_soon(_hold, store, hold, cfg.cluster.lease_ttl,
                               lambda: _read_counters(reader), handed_over, name="hold")

        async def after_mount() -> None:
            if session is not None and peers is not None and disk is None \
                    and cfg.cluster.native_fetch:
                from .cluster.native.fetch import NativeFetch, soft_capi

                if soft_capi() is not None:
                    native = NativeFetch(session.engine, peers, reader.tiers, memory, index,
                                         reader.policy.small_file_limit)
                    session.fetch = native
                    reader.tiers.attach_native(native)
                    nursery.start_soon(native.run, nursery, name="native-fetch")
            if index.pages is not None:
                nursery.start_soon(_watch_pages, index, info, name="manifest-pages")
            if cfg.metrics.listen:                # off by default: no thread, no socket
                if req.upgrade and session is not None:
                    await session.predecessor_gone()      # it holds the port until it exits
                nursery.start_soon(_export_metrics, cfg, ops, peers, store, path, name="metrics")
            knobs = tuning.KernelKnobs(cfg.fuse.max_background, cfg.fuse.congestion_threshold,
                                       cfg.fuse.read_ahead_kb)
            await trio.to_thread.run_sync(tuning.apply, path, knobs)
            log.info("mounted %s v%d at %s (%s engine%s)", info.name, info.version, path, engine,
                     f", {session.transport}" if session is not None else "")
            # MAINPID: after `systemctl reload` (an upgrade) this daemon is the unit's main
            # process, not the one that started it (mount/kspeedfs@.service)
            _systemd_notify(f"MAINPID={os.getpid()}\nREADY=1")
            if ready:
                ready(path)

        # a sealed copy of the manifest for the supervisor, kept for the mount's life so a
        # supervisor started again gets it too; a resumed daemon keeps the copy it came
        # with (the same memfd: no second copy in memory); the blob itself is not kept
        manifest_fd = req.manifest_fd
        if session is None or not req.supervise:
            if manifest_fd is not None:
                os.close(manifest_fd)
            manifest_fd = None
        elif manifest_fd is None:
            manifest_fd = sealed.seal(info, blob)
        del blob
        if session is not None:
            try:
                await _serve_native(session, nursery, after_mount, req, manifest_fd,
                                    secret_environment(cfg))
            finally:
                if pages:
                    pages.close()
        else:
            await _serve_pyfuse3(ops, path, cfg, info, req, nursery, after_mount, pages, record)
        nursery.cancel_scope.cancel()
    log.info("%s %s; %s", "handed over" if session is not None and session.handed_over
             else "unmounted", path, reader.statistics())


async def _serve_pyfuse3(ops: Operations, path: str, cfg: Config, info: DatasetInfo,
                         req: MountRequest, nursery: trio.Nursery,
                         after_mount: Callable[[], Awaitable[None]], pages: PageCache | None,
                         record: LocalMount) -> None:
    """Mount with pyfuse3 and run its request loop until unmounted; then the page-cache
    pushes stop before the session is destroyed (``pyfuse3.close`` unmounts). Its control
    socket answers ``query`` and ``stats`` (it has no connection to hand over)."""
    from .fuse.upgrade import HandoverServer

    options = set(pyfuse3.default_options) | {"ro", f"fsname=kspeedfs:{info.name}", "subtype=kspeedfs"}
    if cfg.fuse.allow_other:
        options.add("allow_other")
    if req.nonempty:
        options.add("nonempty")
    pyfuse3.init(ops, path, options)
    try:
        control = HandoverServer(path, info.name, info.version, -1, lambda: {"transport": "pyfuse3"},
                                 _no_handover, stats=ops.stats_record, record=record)
        await nursery.start(control.run, name="control")
        nursery.start_soon(_on_signals, pyfuse3.terminate, name="signals")
        nursery.start_soon(after_mount, name="after-mount")
        await pyfuse3.main()
    finally:
        if pages:
            pages.close()
        pyfuse3.close(unmount=True)


async def _no_handover() -> None:
    raise AssertionError("a pyfuse3 mount refuses every handover")     # upgrade.py


async def _serve_native(session: NativeSession, nursery: trio.Nursery,
                        after_mount: Callable[[], Awaitable[None]], req: MountRequest,
                        manifest_fd: int | None, secrets: dict[str, str]) -> None:
    """Mount with the native engine (or take the live mount over from its daemon, or
    from its supervisor after a crash) and answer its queue until unmounted or handed
    over; always leaves the C threads joined, and the mount gone unless a successor
    serves it. A supervised mount tells its supervisor "bye" when it ends cleanly, and
    starts a new one if it dies first (``supervisor.Supervised``); ``manifest_fd``
    (sealed, ``manifest/sealed.py``, closed here) and ``secrets`` (environment) go to
    each supervisor it starts."""
    from .fuse import supervisor
    from .fuse import upgrade as handover
    from .fuse.native import RING_LIFECYCLE

    def start() -> trio.socket.SocketType:
        return trio.socket.from_stdlib_socket(supervisor.spawn(
            session.path, session.engine.fds(), session.state(), list(req.argv), req.logfile,
            session.cfg.resume_patience, manifest_fd, secrets))

    supervised = None
    try:
        if req.upgrade or req.resume:
            sock = await handover.take_over(session.path, session.info.name, session.info.version,
                                            session.adopt, path=req.resume)
            if req.resume:                        # the supervisor stays on this socket
                supervised = supervisor.Supervised(session.path, sock, start)
                await sock.send(json.dumps({"state": session.state()}).encode())
            else:
                sock.close()
        else:
            await trio.to_thread.run_sync(session.mount)
        if supervised is None and req.supervise and session.transport == "io_uring":
            # a supervisor holding the connection of a crashed io_uring daemon would keep the
            # readers its rings held hanging; unsupervised, the crash ends the connection
            # (ENOTCONN) and the next ``kspeedfs mount`` cleans it up (fuse/native.py)
            log.info("io_uring mount: not supervised (%s)", RING_LIFECYCLE)
        elif supervised is None and req.supervise:
            supervised = supervisor.Supervised(session.path, start(), start)
    except BaseException:
        if manifest_fd is not None:
            os.close(manifest_fd)
        raise
    try:
        nursery.start_soon(_on_signals, session.terminate, name="signals")
        nursery.start_soon(after_mount, name="after-mount")
        if supervised is not None:
            nursery.start_soon(supervised.watch, name="supervisor-watch")
        await session.serve()
    finally:
        if supervised is not None:            # no new supervisor for a connection ending
            supervised.watching.cancel()
        session.terminate()
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(session.close)
        if manifest_fd is not None:
            os.close(manifest_fd)
    if supervised is not None:                # a clean end: the supervisor may go
        await supervised.bye("handed over" if session.handed_over else "unmounted")
