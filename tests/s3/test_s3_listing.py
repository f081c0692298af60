"""The parallel listing (``objstore/listing.py``) against a real S3 server (moto), whose
pages hold 1,000 keys: a listing of many small directories splits into key ranges, and
every key comes back exactly once, also from a store that ignores ``StartAfter``."""
from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from kspeedfs import config
from kspeedfs.objstore import connect
from kspeedfs.objstore.bucket import ObjectInfo
from kspeedfs.objstore.listing import list_objects
from kspeedfs.objstore.s3 import S3Bucket
from tests.fixtures.s3 import FaultProxy, S3Server

# root objects, one top directory of 60 directories of 50 keys (the split looks one
# level down), an empty directory's marker and a directory after it
KEYS = (["a.txt", "m.txt"] + [f"t/d{d:03d}/k{i:02d}" for d in range(60) for i in range(50)]
        + ["t/marker/", "u/x", "u/y/z"])


@pytest.fixture(scope="module")
def layout(s3_server: S3Server) -> str:
    c = s3_server.client()
    c.create_bucket(Bucket="kst-listing")
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda k: c.put_object(Bucket="kst-listing", Key=k, Body=b"x"), KEYS))
    return "s3://kst-listing"


@pytest.fixture
def slow_pages(s3_server: S3Server) -> Iterator[FaultProxy]:
    """Every listing page 0.1 s late: the head always waits on the server, so it splits."""
    with FaultProxy(s3_server) as proxy:
        proxy.delay(1000, 0.1)
        yield proxy


def _bucket(proxy: FaultProxy, url: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """``url`` through the proxy, with the test server's settings only."""
    for k in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(k)
    for k, v in proxy.env().items():
        monkeypatch.setenv(k, v)
    return connect(url, config.load(environ={}).source)


def _listed(bucket: Any, caplog: pytest.LogCaptureFixture) -> list[str]:
    with caplog.at_level(logging.DEBUG, logger="kspeedfs.objstore.listing"):
        keys = [o.key for o in list_objects(bucket, 8)]
    assert "listing split after" in caplog.text, "the listing never split"
    return keys


def test_small_directories_split_into_ranges(layout: str, slow_pages: FaultProxy,
                                             caplog: pytest.LogCaptureFixture,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    keys = _listed(_bucket(slow_pages, layout, monkeypatch), caplog)
    assert sorted(keys) == sorted(KEYS)
    # 3,005 keys: 4 pages flat; each range ends on the page that passes it
    assert slow_pages.counts["requests"] <= 4 + 2 + 8, slow_pages.counts


class IgnoresStartAfter(S3Bucket):
    """A real S3 bucket listed as a store that ignores the offset (fake-gcs-server and
    Azurite do): every range starts from the first key."""

    def list_keys(self, prefix: str, start_after: str = "", expect: int = 0) -> Iterator[list[ObjectInfo]]:
        return super().list_keys(prefix, "", expect)


def test_a_store_ignoring_the_offset_lists_each_key_once(layout: str, slow_pages: FaultProxy,
                                                         caplog: pytest.LogCaptureFixture,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    b = _bucket(slow_pages, layout, monkeypatch)
    keys = _listed(IgnoresStartAfter(b.url, b.client, b.attempts), caplog)
    assert sorted(keys) == sorted(KEYS)


def test_a_versioned_bucket_lists_flat(s3_server: S3Server, slow_pages: FaultProxy,
                                       caplog: pytest.LogCaptureFixture,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """ListObjectVersions is not split (``S3Bucket.splits``: moto's ``KeyMarker`` on a key
    that does not exist skips the key after it): each key once, as its latest version."""
    c = s3_server.client()
    c.create_bucket(Bucket="kst-listing-v")
    c.put_bucket_versioning(Bucket="kst-listing-v", VersioningConfiguration={"Status": "Enabled"})
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda k: c.put_object(Bucket="kst-listing-v", Key=k, Body=b"x"), KEYS))
    latest = {k: c.put_object(Bucket="kst-listing-v", Key=k, Body=b"yy")["VersionId"]
              for k in KEYS[::97]}            # a second version of some keys, all over
    with caplog.at_level(logging.DEBUG, logger="kspeedfs.objstore.listing"):
        got = list_objects(_bucket(slow_pages, "s3://kst-listing-v", monkeypatch), 8)
    assert "listing split after" not in caplog.text
    assert sorted(o.key for o in got) == sorted(KEYS)
    assert all({o.key: o.version_id for o in got}[k] == v for k, v in latest.items())
    assert all(o.size == (2 if o.key in latest else 1) for o in got if not o.key.endswith("/"))
