"""``s3://BUCKET/PREFIX``: what an import names and a dataset records as its source."""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import ConfigError

# S3's bucket naming rules (3-63 characters, lower case, digits, dots and hyphens)
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


@dataclass(frozen=True)
class S3Url:
    """A bucket and a key prefix; keys below the prefix are the dataset's paths.

    The prefix is a "directory": ``s3://b/train`` imports the keys under ``train/``
    (a trailing slash is added), never ``training.txt``; ``s3://b`` the whole bucket."""

    bucket: str
    prefix: str      # "" or ends with "/"

    @classmethod
    def parse(cls, url: str) -> S3Url:
        if not url.startswith("s3://"):
            raise ConfigError(f"{url!r} is not an s3://BUCKET/PREFIX URL")
        bucket, _, prefix = url[len("s3://"):].partition("/")
        if not _BUCKET.match(bucket):
            raise ConfigError(f"{url!r}: {bucket!r} is not an S3 bucket name "
                              "(3-63 characters: a-z 0-9 . -)")
        prefix = prefix.lstrip("/")
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        return cls(bucket, prefix)

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    def key(self, path: bytes) -> str:
        """The object key of a dataset path (UTF-8: S3 keys are Unicode)."""
        return self.prefix + path.decode()
