"""A volume's context (the PV's ``volumeAttributes``, or an inline volume's) → what to
mount, checked before anything runs.

Keys:

=====================  ===================================================================
``dataset``            required: the dataset's name
``version``            optional: the version; without it the current one, pinned at stage
                       time (the stage mounts exactly that version until it is unstaged)
``preload``            ``true``/``false`` (default false): ask the cluster to hold the
                       version while any mount of it lives (``kspeedfs mount
                       --unload-on-exit``; etcd store only). A standing preload is the
                       preload Job's (``kspeedfs preload``), not a volume's.
``priority``           with ``preload``: -1000..1000 (default 0)
``SECTION.KEY``        a config key from :data:`SAFE_KEYS`, passed as ``--set``
``csi.storage.k8s.io/*``  what kubelet adds (pod name, ephemeral): read, never passed on
=====================  ===================================================================

Any other key is refused (INVALID_ARGUMENT), so a misspelt key is an error, not a
silent default.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ..cli.options import dataset_name, priority, version
from .errors import InvalidArgument

#: kubelet's prefix for the keys it adds to a volume context
KUBELET_PREFIX = "csi.storage.k8s.io/"
EPHEMERAL_KEY = "csi.storage.k8s.io/ephemeral"

# Config keys a volume may set for its own mount. A key is here only if it changes this
# mount alone and names no host path, credential or process identity: a PV's author is
# not the node's administrator. Left out on purpose: store.*, cluster.* but hedging
# (the store and the cluster are the node's), source.* (credentials), cache.disk_dir and
# log.dir (host paths), fuse.engine and fuse.io_uring (an io_uring mount has no
# supervisor, which is what a staged volume relies on), fuse.allow_other (always on:
# pods run as any uid).
SAFE_KEYS = frozenset({
    "cache.memory",
    "fuse.entry_timeout", "fuse.attr_timeout", "fuse.prefetch_chunks", "fuse.blksize",
    "fuse.xattrs", "fuse.push_pages", "fuse.max_background", "fuse.congestion_threshold",
    "fuse.read_ahead_kb", "fuse.workers", "fuse.threads", "fuse.max_pages", "fuse.splice",
    "cluster.hedge", "cluster.hedge_factor", "cluster.hedge_floor", "cluster.hedge_cap",
    "cluster.hedge_budget",
    "log.level", "log.slow_op", "metrics.listen",
})

_BOOL = {"true": True, "false": False}


@dataclass(frozen=True)
class VolumeSpec:
    """What one volume mounts."""

    dataset: str
    version: int | None                 # None: the current version, pinned at stage time
    preload: bool = False
    priority: int = 0
    settings: tuple[tuple[str, str], ...] = field(default=())   # (key, value), sorted
    ephemeral: bool = False

    def mount_args(self, pinned: int) -> list[str]:
        """``kspeedfs mount`` arguments after DATASET MOUNTPOINT for ``pinned``."""
        out = ["--version", str(pinned), "--allow-other"]
        if self.preload:
            out += ["--unload-on-exit", "--priority", str(self.priority)]
        for key, value in self.settings:
            out += ["--set", f"{key}={value}"]
        return out


def _typed(key: str, text: str, parse: Callable[[str], object]) -> object:
    try:
        return parse(text)
    except argparse.ArgumentTypeError as e:
        raise InvalidArgument(f"volume context {key}: {e}") from None


def parse(context: Mapping[str, str], check_setting: Callable[[str, str], None] | None = None
          ) -> VolumeSpec:
    """The volume context as a :class:`VolumeSpec`; ``InvalidArgument`` (one line) for a
    missing ``dataset``, a bad value or a key not allowed. ``check_setting(key, value)``
    validates a config value (the plugin passes the config loader's check)."""
    if not context.get("dataset"):
        raise InvalidArgument("volume context: 'dataset' is required (the dataset's name)")
    name = str(_typed("dataset", context["dataset"], dataset_name))
    ver = int(str(_typed("version", context["version"], version))) if context.get("version") else None
    flags = {}
    for key in ("preload", EPHEMERAL_KEY):
        text = context.get(key, "false").strip().lower()
        if text not in _BOOL:
            raise InvalidArgument(f"volume context {key}: {context[key]!r} is not true or false")
        flags[key] = _BOOL[text]
    prio = int(str(_typed("priority", context["priority"], priority))) if "priority" in context else 0
    if "priority" in context and not flags["preload"]:
        raise InvalidArgument("volume context priority: only with preload=true")
    settings = []
    for key, value in sorted(context.items()):
        if key in ("dataset", "version", "preload", "priority") or key.startswith(KUBELET_PREFIX):
            continue
        if "." not in key:
            raise InvalidArgument(f"volume context: unknown key {key!r} (dataset, version, "
                                  "preload, priority, or a SECTION.KEY setting)")
        if key not in SAFE_KEYS:
            raise InvalidArgument(f"volume context: {key!r} cannot be set per volume "
                                  f"(allowed: {', '.join(sorted(SAFE_KEYS))})")
        if check_setting is not None:
            check_setting(key, value)
        settings.append((key, value))
    return VolumeSpec(name, ver, flags["preload"], prio, tuple(settings), flags[EPHEMERAL_KEY])
