"""A verified manifest in a sealed memfd: the copy a mount's supervisor holds for the
daemons it starts again (``fuse/supervisor.py``), so a resume needs no store.

    seal(info, blob) -> fd        the daemon, after ``load_dataset`` verified both
      (supervisor: holds the fd, passes it to each daemon it starts: ``--manifest-fd``)
    unseal(fd, name, version)     the resumed daemon: the same checks as the store's
        -> (info, blob)           (``DatasetInfo.from_json``, ``verify_blob``)

Without it a resume loaded the manifest from the store: a daemon that crashed while etcd
was down (or the store's directory was gone, or the version had been removed) could not
start again, and after ``fuse.resume_patience`` the mount was dead.

Layout: one line, the SHA-256 (hex) of the info record's JSON, a space and that JSON;
then the blob (checked against the record's digests, as the store's). Sealed against
writes, growth and shrinking, so neither the supervisor nor a daemon can change it; the
bytes are still checked on every unseal (they came from a process, not a store, but a
check costs ~1 ms per MB and makes a wrong copy one log line and a load from the store,
never a wrong mount). The record's own digest: the blob's digests do not cover the
record, and a fuzz pass found a record with a key changed that still parsed (the field
then took its default).
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os

from ..errors import ManifestCorrupt
from .store.base import DatasetInfo, verify_blob

#: an info record's line is ~500 bytes; a header longer than this is not one
HEADER_LIMIT = 64 << 10

_SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


def seal(info: DatasetInfo, blob: bytes) -> int:
    """A new sealed memfd holding ``info`` and its (verified) ``blob``; the caller owns
    the fd (close-on-exec: pass it on explicitly)."""
    fd = os.memfd_create(f"kspeedfs-manifest-{info.name}@{info.version}",
                         os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        record = json.dumps(info.to_json(), separators=(",", ":")).encode()
        data = hashlib.sha256(record).hexdigest().encode() + b" " + record + b"\n" + blob
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def unseal(fd: int, name: str, version: int | None) -> tuple[DatasetInfo, bytes]:
    """The info and blob in sealed memfd ``fd``, checked as a store's are and against the
    dataset ``name`` and ``version`` asked for (None: any); ``ManifestCorrupt`` if
    anything is off. ``fd`` stays open."""
    try:
        size = os.fstat(fd).st_size
        if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & _SEALS != _SEALS:
            raise ManifestCorrupt("the manifest copy is not sealed")
        data = os.pread(fd, size, 0)
    except OSError as e:
        raise ManifestCorrupt(f"the manifest copy cannot be read: {e.strerror}") from None
    if len(data) != size:
        raise ManifestCorrupt(f"the manifest copy is short ({len(data)} of {size} bytes)")
    end = data.find(b"\n", 0, HEADER_LIMIT)
    if end < 0:
        raise ManifestCorrupt("the manifest copy has no info record")
    digest, _, record = data[:end].partition(b" ")
    if digest != hashlib.sha256(record).hexdigest().encode():
        raise ManifestCorrupt("the manifest copy's info record does not match its digest")
    try:
        info = DatasetInfo.from_json(json.loads(record))
    except ValueError as e:          # (json's errors are ValueErrors, bad UTF-8 too)
        raise ManifestCorrupt(f"the manifest copy's info record: {e}") from None
    if info.name != name or (version is not None and info.version != version):
        raise ManifestCorrupt(f"the manifest copy is {info.name}@{info.version}, not "
                              f"{name}@{'current' if version is None else version}")
    return info, verify_blob(info, data[end + 1:])
