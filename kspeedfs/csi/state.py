"""What the plugin has staged and published, kept on disk so that a restarted plugin
knows it.

One JSON file per volume, ``<state_dir>/volumes/<digest of the volume id>.json``,
replaced atomically (written beside, fsynced, renamed). The record is written *before*
the mount it describes is made and removed *after* the mount is gone, so a plugin
killed in between finds a record whose mount may or may not exist, and each call
checks the kernel's mount table before it trusts a record:

    NodeStageVolume      record (version pinned) → kspeedfs mount → (record kept)
    NodePublishVolume    bind mount → record += target
    NodeUnpublishVolume  umount target → record -= target
    NodeUnstageVolume    refused while a recorded target is still mounted;
                         umount staging → stager stop → record removed
    plugin start         a mount whose daemon is of another kspeedfs version is handed
                         to a new one (kspeedfs mount --upgrade) → record units += new

Calls on one volume are serialized by the server (``node.py``); different volumes'
records are different files.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class VolumeRecord:
    """One staged volume (or ephemeral inline volume) on this node."""

    volume_id: str
    staging_path: str
    dataset: str
    version: int                        # pinned at stage time
    context: dict[str, str]             # as given at stage time: a repeat must match it
    units: list[str]                    # the stager's names for the mount's processes: the
                                        # stage's, then one per upgrade (a new daemon's)
    mounted_by: str = ""                # the kspeedfs version whose daemon serves it
    ephemeral: bool = False
    publishes: list[str] = field(default_factory=list)   # target paths, in publish order
    staged_at: float = field(default_factory=time.time)


def volume_key(volume_id: str) -> str:
    """A file name for a volume id (ids are opaque strings of up to 128 bytes)."""
    return hashlib.sha256(volume_id.encode("utf-8", "surrogateescape")).hexdigest()[:32]


class StateDir:
    """The records under ``root`` (created 0700: they name datasets and pod paths)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.volumes = self.root / "volumes"
        self.volumes.mkdir(parents=True, exist_ok=True, mode=0o700)

    def _path(self, volume_id: str) -> Path:
        return self.volumes / f"{volume_key(volume_id)}.json"

    def get(self, volume_id: str) -> VolumeRecord | None:
        try:
            data = json.loads(self._path(volume_id).read_text())
        except FileNotFoundError:
            return None
        return VolumeRecord(**data)

    def put(self, record: VolumeRecord) -> None:
        path = self._path(record.volume_id)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        with open(tmp, "w") as f:
            json.dump(asdict(record), f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fd = os.open(self.volumes, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def remove(self, volume_id: str) -> None:
        self._path(volume_id).unlink(missing_ok=True)

    def __iter__(self) -> Iterator[VolumeRecord]:
        for path in sorted(self.volumes.glob("*.json")):
            yield VolumeRecord(**json.loads(path.read_text()))

    def ephemeral_staging(self, volume_id: str) -> str:
        """Where an inline volume (published without a stage) gets its own mount."""
        return str(self.root / "ephemeral" / volume_key(volume_id))
