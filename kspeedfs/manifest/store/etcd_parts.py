"""A manifest blob in etcd, as parts: ``P manifests/<name>/v<N>/<i>``, PART_SIZE bytes each.

Why parts, and why apart from ``datasets/``: ``etcd.py``'s docstring (the key layout).
A version's info record (``etcd_versions.py``) states how many parts of what size hold
its blob (:func:`check_layout`) and carries the blob's SHA-256, so the parts need no
signature of their own: a part replaced behind the store's back fails the blob's
digests (``base.verify_blob``).
"""
from __future__ import annotations

from collections.abc import Iterator

from .base import check_name
from .etcd_client import EtcdClient

PART_SIZE = 1 << 20          # bytes per manifest part key; etcd's request limit is 1.5 MiB


def check_layout(parts: object, part_size: object, manifest_size: int) -> None:
    """``ValueError`` unless ``parts`` parts of ``part_size`` bytes (as an info record
    states them) hold exactly ``manifest_size`` bytes, in parts this store would write."""
    if type(parts) is not int or type(part_size) is not int or not 0 < part_size <= PART_SIZE:
        raise ValueError("parts/part_size missing or invalid")
    if parts != -(-manifest_size // part_size):
        raise ValueError(f"{parts} parts of {part_size} bytes cannot hold {manifest_size} bytes")


class ManifestParts:
    """The ``manifests/`` keys of one etcd prefix: write, read and delete a version's parts.

    Blocking and thread-safe: every request goes through the store's shared
    :class:`EtcdClient` with ``call`` (one endpoint at a time). Parts are written before
    the version's info record makes them visible and deleted after it is gone, both by
    :class:`~kspeedfs.manifest.store.etcd.EtcdStore`; this class neither verifies a blob
    nor knows whether its version exists."""

    def __init__(self, client: EtcdClient, prefix: str) -> None:
        self.client = client
        self.prefix = prefix

    def _dir(self, name: str, version: int) -> str:
        return f"{self.prefix}manifests/{check_name(name)}/v{version}/"

    def key(self, name: str, version: int, index: int) -> str:
        """The etcd key of one manifest part (for tests and ``etcdctl`` forensics)."""
        return f"{self._dir(name, version)}{index}"

    def put(self, name: str, version: int, blob: bytes) -> int:
        """Write ``blob`` as the parts of ``name`` v``version``; returns how many."""
        parts = range(0, len(blob), PART_SIZE)
        for i, off in enumerate(parts):
            key, chunk = self.key(name, version, i), blob[off:off + PART_SIZE]
            # call() runs op before returning: the loop variables are this part's
            self.client.call(lambda c: c.put(key, chunk))  # noqa: B023
        return len(parts)

    def read(self, name: str, version: int, count: int) -> Iterator[tuple[str, bytes | None]]:
        """Each of the ``count`` parts in order, read as the caller reaches it: (its
        key, its bytes or None when the key is missing)."""
        for i in range(count):
            key = self.key(name, version, i)
            value, _ = self.client.call(lambda c: c.get(key))  # noqa: B023 - as in put
            yield key, value

    def delete(self, name: str, version: int) -> None:
        self.client.call(lambda c: c.delete_prefix(self._dir(name, version)))

    def delete_all(self, name: str) -> None:
        """Every version's parts, orphans of an interrupted publish included."""
        self.client.call(lambda c: c.delete_prefix(f"{self.prefix}manifests/{name}/"))
