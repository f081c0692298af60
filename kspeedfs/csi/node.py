"""The CSI Node service: stage a kspeedfs mount once per volume on this node, bind it
read-only into each pod that uses it, and take both down in the reverse order.

    NodeStageVolume(volume, staging, context)
        context → VolumeSpec (context.py); dataset@version looked up in the store and
        pinned; record written (state.py); ``kspeedfs mount DATASET STAGING --version V``
        run by the stager (stager.py) outside this process
    NodePublishVolume(volume, staging, target)       (no staging + ephemeral: staged here)
        read-only bind staging → target (binds.py); record += target
    NodeUnpublishVolume(volume, target)
        umount target; record -= target; an ephemeral volume's last → its own unstage
    NodeUnstageVolume(volume, staging)
        FAILED_PRECONDITION while a recorded target is still mounted; else umount
        staging (the daemon and its supervisor leave by themselves), stager stop, record
        removed
    NodeGetVolumeStats(volume, path)   statfs of the path: the dataset's bytes and files
    upgrade_mounts (at plugin start)
        each staged mount whose daemon is of another kspeedfs version: ``kspeedfs mount
        --upgrade`` by the stager, under a new unit; readers see a pause, not an error

Every call is idempotent: a repeat of a call that succeeded succeeds and changes
nothing, checked against the kernel's mount table, not only the record (a plugin killed
between a mount and its record, or the reverse, converges on the next call kubelet
retries). Calls on one volume run one at a time (``Plugin.lock``); calls on different volumes
run in parallel on the server's threads.
"""
from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import binds, context
from .errors import (
    AlreadyExists,
    CsiError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from .stager import Stager
from .state import StateDir, VolumeRecord, volume_key

log = logging.getLogger(__name__)


@dataclass
class Plugin:
    """What the node service needs from its command line."""

    node_id: str
    version: str                          # kspeedfs's, recorded with each mount it stages
    state: StateDir
    stager: Stager
    mount_command: Sequence[str]          # e.g. ["/usr/local/bin/kspeedfs"]
    common_args: Sequence[str]            # --config/--store/--etcd/--set passed to every mount
    open_store: Callable[[], Any]         # the configured MetadataStore (closed after use)
    check_setting: Callable[[str, str], None] = lambda key, value: None
    etcd: bool = False                    # the store is etcd (preload needs it)
    mount_timeout: float = 300.0
    _locks: dict[str, threading.Lock] = field(default_factory=dict)
    _locks_guard: threading.Lock = field(default_factory=threading.Lock)

    def lock(self, volume_id: str) -> threading.Lock:
        """The lock that serializes calls on ``volume_id``."""
        with self._locks_guard:
            return self._locks.setdefault(volume_id, threading.Lock())


# -- requests -------------------------------------------------------------------------

_READ_ONLY_MODES = {2, 3}   # AccessMode.SINGLE_NODE_READER_ONLY, MULTI_NODE_READER_ONLY


def check_capability(capability: Any) -> None:
    """A kspeedfs volume is a read-only filesystem: a block volume, or a mode that
    writes, exceeds its capabilities (FAILED_PRECONDITION, as the spec says)."""
    if capability is None or not capability.ByteSize():
        raise InvalidArgument("volume_capability is required")
    if capability.WhichOneof("access_type") != "mount":
        raise FailedPrecondition("kspeedfs volumes are filesystems: volumeMode Block is not "
                                 "supported")
    if capability.access_mode.mode not in _READ_ONLY_MODES:
        raise FailedPrecondition("kspeedfs volumes are read-only: use accessModes "
                                 "[ReadOnlyMany]")


# -- stage ----------------------------------------------------------------------------

def stage(p: Plugin, volume_id: str, staging: str, volume_context: dict[str, str],
          ephemeral: bool = False) -> VolumeRecord:
    """Mount the volume's dataset at ``staging`` (idempotent); its record."""
    spec = context.parse(volume_context, p.check_setting)
    if spec.preload and not p.etcd:
        raise InvalidArgument("volume context preload=true needs the cluster's etcd store")
    record = p.state.get(volume_id)
    if record is not None:
        if os.path.abspath(record.staging_path) != os.path.abspath(staging):
            raise AlreadyExists(f"volume {volume_id} is staged at {record.staging_path}, "
                                f"not {staging}")
        if record.context != dict(volume_context):
            raise AlreadyExists(f"volume {volume_id} is staged with another volume context")
        if binds.is_served(staging):
            return record
        # gone (a reboot) or dead (its supervisor gave up): `kspeedfs mount` cleans a
        # dead mount point up before mounting
        log.info("volume %s: recorded at %s but not served: mounting %s@%d again",
                 volume_id, staging, record.dataset, record.version)
    else:
        pinned = _pin(p, spec.dataset, spec.version)
        record = VolumeRecord(volume_id, os.path.abspath(staging), spec.dataset, pinned,
                              dict(volume_context), [f"kspeedfs-csi-{volume_key(volume_id)[:16]}"],
                              mounted_by=p.version, ephemeral=ephemeral)
        if binds.is_mounted(staging):
            raise AlreadyExists(f"{staging} is already a mount point")
    os.makedirs(staging, exist_ok=True)
    for unit in record.units[1:]:
        p.stager.stop(unit)                 # upgrades' units of a mount that is gone
    record.units, record.mounted_by = record.units[:1], p.version
    p.state.put(record)                     # before the mount: a restart knows its unit
    try:
        p.stager.start(record.units[0], _mount_argv(p, record, spec), p.mount_timeout)
    except CsiError:
        if not binds.is_mounted(staging) and not record.publishes:
            p.state.remove(volume_id)       # nothing of it exists: as if never asked
        raise
    log.info("volume %s: %s@%d staged at %s (%s)", volume_id, record.dataset, record.version,
             staging, record.units[0])
    return record


def _mount_argv(p: Plugin, record: VolumeRecord, spec: context.VolumeSpec,
                *extra: str) -> list[str]:
    return [*p.mount_command, "mount", record.dataset, record.staging_path, *extra,
            *spec.mount_args(record.version), *p.common_args]


def upgrade_mounts(p: Plugin) -> int:
    """Hand each staged mount served by a daemon of another kspeedfs version to a daemon
    of this one (``kspeedfs mount --upgrade``, run by the stager under a unit of its own:
    the new daemon and its supervisor live there); the number handed over. A mount that
    refuses is logged and left to its old daemon: it still serves."""
    done = 0
    for record in list(p.state):
        if record.mounted_by == p.version or not binds.is_mounted(record.staging_path):
            continue
        unit = f"{record.units[0]}-{len(record.units)}"
        try:
            p.stager.start(unit, _mount_argv(p, record, context.parse(record.context),
                                             "--upgrade"), p.mount_timeout)
        except CsiError as e:
            log.error("volume %s: upgrade from kspeedfs %s refused: %s", record.volume_id,
                      record.mounted_by or "?", e)
            continue
        log.info("volume %s: %s@%d at %s handed from kspeedfs %s to %s (%s)", record.volume_id,
                 record.dataset, record.version, record.staging_path, record.mounted_by or "?",
                 p.version, unit)
        record.units.append(unit)
        record.mounted_by = p.version
        p.state.put(record)
        done += 1
    return done


def _pin(p: Plugin, dataset: str, version: int | None) -> int:
    """The version to mount: ``version``, or the dataset's current one, as the store has it."""
    from ..errors import DatasetNotFound, StoreUnavailable

    try:
        store = p.open_store()
    except StoreUnavailable as e:
        raise Unavailable(f"metadata store: {e}") from None
    try:
        return int(store.dataset(dataset, version).version)
    except DatasetNotFound:
        at = f"{dataset}@{version}" if version else dataset
        raise NotFound(f"dataset {at} does not exist") from None
    except StoreUnavailable as e:
        raise Unavailable(f"metadata store: {e}") from None
    finally:
        store.close()


def unstage(p: Plugin, volume_id: str, staging: str) -> None:
    """Unmount the volume at ``staging`` (idempotent); refused while it is published."""
    record = p.state.get(volume_id)
    if record is None:
        if binds.is_mounted(staging) and _is_kspeedfs(staging):
            # staged by a plugin whose record is gone: nothing else holds it
            binds.unmount(staging)
        return
    live = [t for t in record.publishes if binds.is_mounted(t)]
    if live != record.publishes:
        record.publishes = live
        p.state.put(record)
    if live:
        raise FailedPrecondition(f"volume {volume_id} is still published at {len(live)} "
                                 f"target(s), first {live[0]}: unpublish them first")
    if binds.is_mounted(record.staging_path):
        binds.unmount(record.staging_path)
    for unit in record.units:
        p.stager.stop(unit)
    p.state.remove(volume_id)
    log.info("volume %s: %s@%d unstaged from %s", volume_id, record.dataset, record.version,
             record.staging_path)


def _is_kspeedfs(path: str) -> bool:
    from .. import mountpoint

    return mountpoint.mounts().get(os.path.abspath(path), "").startswith("fuse.kspeedfs")


# -- publish --------------------------------------------------------------------------

def publish(p: Plugin, volume_id: str, staging: str, target: str,
            volume_context: dict[str, str]) -> None:
    """Bind the staged mount read-only at ``target`` (idempotent)."""
    if not staging:
        if volume_context.get(context.EPHEMERAL_KEY, "").lower() != "true":
            raise FailedPrecondition("staging_target_path is not set: stage the volume first "
                                     "(or use an inline ephemeral volume)")
        record = stage(p, volume_id, p.state.ephemeral_staging(volume_id), volume_context,
                       ephemeral=True)
    else:
        staged = p.state.get(volume_id)
        if (staged is None or os.path.abspath(staged.staging_path) != os.path.abspath(staging)
                or not binds.is_mounted(staging)):
            raise FailedPrecondition(f"volume {volume_id} is not staged at {staging}")
        record = staged
    if binds.is_mounted(target):
        if not binds.same_filesystem(target, record.staging_path):
            raise AlreadyExists(f"{target} is already a mount point of something else")
    else:
        os.makedirs(target, exist_ok=True)
        binds.bind_readonly(record.staging_path, target)
    if target not in record.publishes:
        record.publishes.append(target)
        p.state.put(record)
    log.info("volume %s: published at %s (%d target(s))", volume_id, target,
             len(record.publishes))


def unpublish(p: Plugin, volume_id: str, target: str) -> None:
    """Remove the bind at ``target`` (idempotent); an inline volume's last one also
    unstages it."""
    record = p.state.get(volume_id)
    if binds.is_mounted(target):
        if record is None and not _is_kspeedfs(target):
            raise NotFound(f"{target} is not a kspeedfs volume of this plugin")
        binds.unmount(target)
    try:
        os.rmdir(target)
    except OSError:
        pass                    # gone already, or kubelet's to remove
    if record is None:
        return
    if target in record.publishes:
        record.publishes.remove(target)
        p.state.put(record)
    log.info("volume %s: unpublished from %s (%d target(s) left)", volume_id, target,
             len(record.publishes))
    if record.ephemeral and not record.publishes:
        unstage(p, volume_id, record.staging_path)


# -- stats ----------------------------------------------------------------------------

@dataclass(frozen=True)
class VolumeStats:
    """What NodeGetVolumeStats reports: sizes from statfs, and the volume's condition."""

    bytes_total: int
    files_total: int
    abnormal: bool
    message: str


def stats(p: Plugin, volume_id: str, path: str) -> VolumeStats:
    record = p.state.get(volume_id)
    if record is None:
        raise NotFound(f"volume {volume_id} is not staged on this node")
    if not os.path.lexists(path):
        raise NotFound(f"{path} does not exist")
    if path not in record.publishes and os.path.abspath(path) != record.staging_path:
        raise NotFound(f"{path} is not a path of volume {volume_id}")
    what = f"{record.dataset}@{record.version}"
    try:
        st = os.statvfs(path)
    except OSError as e:
        return VolumeStats(0, 0, True, f"{what}: statfs: {e.strerror}")
    return VolumeStats(st.f_blocks * st.f_frsize, st.f_files, False,
                       f"{what} staged at {record.staging_path}")
