"""Object-store sources: a bucket prefix imported, preloaded and read back like a directory.

    kspeedfs import s3://BUCKET/PREFIX | gs://BUCKET/PREFIX | az://CONTAINER/PREFIX
      url.py          ObjectUrl: the scheme, the bucket and the prefix below which keys
                      are paths
      bucket.py       Bucket: what every store gives (list_keys, list_level,
                      get_range pinned to an identity, record); ObjectInfo, Read
      s3.py           S3Bucket over boto3: the AWS settings chain, versioned listings,
                      If-Match + VersionId
      object_store.py ObjectStoreBucket over obstore (Rust object_store), for the two
                      below: listing, If-Match + version, errors as one line
      gcs.py          gs://: Google's settings (GOOGLE_APPLICATION_CREDENTIALS,
                      STORAGE_EMULATOR_HOST) into an obstore GCSStore
      azure.py        az://: Azure's settings (connection string, account + key or
                      SAS) into an obstore AzureStore
      listing.py      list_objects(): the prefix listed in parallel (key ranges
                      split at common prefixes), the same for every store
      source.py       ObjectSource: the importer's ImportSource (keys → the entry
                      tree, ranges read by ranged GETs); the manifest is format 3
      origin.py       ObjectOrigin: ``origin.Origin`` reading extents by ranged GETs
                      pinned to their identity, several in flight, each checked
                      against its xxh3

:func:`connect` picks the store by the URL's scheme; nothing else does.

Why boto3 for S3 and obstore for the others: measured against each other on the same
moto server (``python -m bench.s3_clients``, docs/design.md "Object-store sources"):
level on ranged GETs in MB/s and client CPU per GB, obstore lists 1.25x faster; boto3
alone resolves the whole AWS settings chain (profiles, ~/.aws files, SSO, instance
roles), and its retry modes do the backoff. For GCS and Azure, obstore is one
maintained client for both (no protobuf or gRPC, which google-cloud-storage would
bring beside Debian's etcd3 stack), and takes each platform's credentials itself.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .url import ObjectUrl, is_object_url

if TYPE_CHECKING:
    from ..config import SourceConfig
    from .bucket import Bucket

__all__ = ["ObjectUrl", "connect", "is_object_url"]


def connect(url: str, cfg: SourceConfig, record: dict[str, str] | None = None) -> Bucket:
    """The bucket of ``url`` (``s3://``, ``gs://``, ``az://``) with this host's settings;
    ``record``, a manifest's source record, fills in where the bucket is when nothing
    configured says. ``SourceError`` (one line) if the client cannot be made."""
    parsed = ObjectUrl.parse(url)
    if parsed.scheme == "s3":
        from . import s3
        return s3.connect(parsed, cfg, record)
    if parsed.scheme == "gs":
        from . import gcs
        return gcs.connect(parsed, cfg, record)
    from . import azure
    return azure.connect(parsed, cfg, record)
