"""Paged manifests whose only home is a bucket (``store.pages = s3://…``,
objstore/pages.py): no node and no mount has a page directory besides the nodes' own
copies (cluster/page_copy.py). The import on the client host writes the pages to the
bucket; a preload fills each node's copy from its peer or the bucket; a mount (and a library handle) on a
node's host reads every file through that copy, and a version no node preloaded through the
node's ask socket (cluster/page_ask.py), which gets each page from the bucket.

The S3 server (moto) runs on the etcd host's rail-1 address, as in test_cluster_s3.py.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.fixtures.cluster import Cluster, HostProcess, library_reads, write_small_files
from tests.fixtures.s3 import ACCESS_KEY, REGION, SECRET_KEY, moto_on_host

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces, FUSE)")

BUCKET = "kst-pages"
MAKE_BUCKET = ("import boto3, sys; "
               "boto3.client('s3', endpoint_url=sys.argv[1]).create_bucket(Bucket=sys.argv[2])")
LIST = """
import boto3, sys
c = boto3.client("s3", endpoint_url=sys.argv[1])
for page in c.get_paginator("list_objects_v2").paginate(Bucket=sys.argv[2]):
    for o in page.get("Contents", ()):
        print(o["Key"])
"""

class BucketCluster(Cluster):
    """Every process's store.pages is the bucket; each node its own page copy."""

    @property
    def endpoint(self) -> str:
        return f"http://{self.etcd_host.address(1)}:9000"

    def copy(self, i: int) -> Path:
        return self.base / f"copy-n{i}"

    def common(self) -> list[str]:
        return [*super().common(), "--set", f"store.pages=s3://{BUCKET}/pages",
                "--set", "store.paged_above=4096", "--set", f"source.endpoint={self.endpoint}"]

    def start_node(self, i: int, *extra: str) -> HostProcess:
        return super().start_node(i, "--set", f"cluster.page_copy={self.copy(i)}", *extra)


def _files(d: Path) -> set[str]:
    return {p.name for p in d.rglob("*") if p.is_file() and not p.name.endswith(".tmp")}


def test_mounts_read_a_manifest_whose_pages_are_only_in_a_bucket(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for k in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(k)
    for k, v in {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                 "AWS_REGION": REGION, "AWS_EC2_METADATA_DISABLED": "true",
                 "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}.items():
        monkeypatch.setenv(k, v)                  # every process of the cluster inherits them
    files = write_small_files(tmp_path / "source", seed=9, files=1200, dirs=5, max_size=2000)
    c = BucketCluster(tmp_path / "c", 2)
    try:
        c.start()
        moto_on_host(c.etcd_host, c.client)
        c.client.run([sys.executable, "-c", MAKE_BUCKET, c.endpoint, BUCKET], timeout=60)

        c.ks(["import", str(tmp_path / "source"), "--name", "paged", "--chunk-size",
              c.chunk_size, "-q"])
        keys = c.client.run([sys.executable, "-c", LIST, c.endpoint, BUCKET]).stdout.split()
        pages = {k.rsplit("/", 1)[1] for k in keys}
        assert len(pages) >= 3 and all(k.startswith("pages/") for k in keys)   # a table, 2+ data
        c.ks(["preload", "paged", "--timeout", "90"])
        for i in (1, 2):                          # each copy whole, from its peer or the bucket
            assert _files(c.copy(i)) == pages, f"n{i}'s copy"

        mnt = c.mount("paged", "--set", f"cluster.page_copy={c.copy(2)}")
        for rel, data in files.items():
            assert (mnt / rel).read_bytes() == data, rel
        c.unmount(mnt)
        library = {"cluster.page_copy": str(c.copy(2))}       # the library, as a mount
        assert library_reads(c, tmp_path, "paged", files, library) == len(files)

        # a version no node preloads: its pages asked of n2, which gets them from the bucket
        c.ks(["import", str(tmp_path / "source" / "d3"), "--name", "cold", "--chunk-size",
              c.chunk_size, "-q"])
        mnt = c.mount("cold", "--set", f"cluster.page_copy={c.copy(2)}")
        for rel, data in files.items():
            if rel.startswith("d3/"):
                assert (mnt / rel[3:]).read_bytes() == data, rel
        c.unmount(mnt)
        assert _files(c.copy(2)) > pages
    finally:
        c.close()
