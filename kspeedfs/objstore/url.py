"""``s3://BUCKET/PREFIX``, ``gs://BUCKET/PREFIX``, ``az://CONTAINER/PREFIX``: what an import
names and a dataset records as its source.

Azure's URL names the container only, as adlfs/fsspec and obstore write it: the storage
account comes from the settings (``AZURE_STORAGE_ACCOUNT``, a connection string,
``source.azure_account``; ``azure.py``), as a bucket's endpoint does for S3.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import ConfigError

SCHEMES = ("s3", "gs", "az")

# each store's naming rules for a bucket (container), and how a message says them
_NAMES: dict[str, tuple[re.Pattern[str], str]] = {
    "s3": (re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$"),
           "an S3 bucket name (3-63 characters: a-z 0-9 . -)"),
    "gs": (re.compile(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$"),
           "a GCS bucket name (3-222 characters: a-z 0-9 . _ -)"),
    "az": (re.compile(r"^(?!.*--)[a-z0-9][a-z0-9-]{1,61}[a-z0-9]$"),
           "an Azure container name (3-63 characters: a-z 0-9 -, no --)"),
}


def is_object_url(source: str) -> bool:
    """Whether ``source`` names a bucket prefix (any scheme above) rather than a directory."""
    return any(source.startswith(f"{s}://") for s in SCHEMES)


@dataclass(frozen=True)
class ObjectUrl:
    """A bucket (container) and a key prefix; keys below the prefix are the dataset's paths.

    The prefix is a "directory": ``s3://b/train`` imports the keys under ``train/``
    (a trailing slash is added), never ``training.txt``; ``s3://b`` the whole bucket."""

    scheme: str      # "s3", "gs" or "az"
    bucket: str
    prefix: str      # "" or ends with "/"

    @classmethod
    def parse(cls, url: str) -> ObjectUrl:
        scheme, sep, rest = url.partition("://")
        if not sep or scheme not in SCHEMES:
            raise ConfigError(f"{url!r} is not an s3://, gs:// or az://BUCKET/PREFIX URL")
        bucket, _, prefix = rest.partition("/")
        pattern, rule = _NAMES[scheme]
        if not pattern.match(bucket):
            raise ConfigError(f"{url!r}: {bucket!r} is not {rule}")
        prefix = prefix.lstrip("/")
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        return cls(scheme, bucket, prefix)

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.prefix}"

    def key(self, path: bytes) -> str:
        """The object key of a dataset path (UTF-8: keys are Unicode in every store)."""
        return self.prefix + path.decode()

    def name(self, key: str) -> str:
        """The URL of object ``key``, for messages."""
        return f"{self.scheme}://{self.bucket}/{key}"
