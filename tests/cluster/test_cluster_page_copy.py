"""Paged manifests without a shared page directory: each node copies a preloaded
version's pages to its host (cluster/page_copy.py), from peers, and a mount (or a
library handle) on that host reads them there; a page missing from the copy is asked of the node by the
mount's page map (cluster/page_ask.py).

Three nodes on test hosts; only n1 has ``store.pages`` (as the importing client does),
n2 and n3 have none, each node its own ``cluster.page_copy``. The mounts have no
``store.pages``: every manifest page they read is their host's node's copy.
"""
from __future__ import annotations

import json
import os
import time
import zlib
from pathlib import Path

import pytest

from tests.fixtures.cluster import Cluster, HostProcess, library_reads, write_small_files

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces, FUSE)")


class PagedCluster(Cluster):
    """Each node its own page copy under the cluster's base; n1 also ``store.pages``."""

    def copy(self, i: int) -> Path:
        return self.base / f"copy-n{i}"

    @property
    def shared(self) -> Path:
        return self.base / "pages"

    def start_node(self, i: int, *extra: str) -> HostProcess:
        own = ["--set", f"cluster.page_copy={self.copy(i)}"]
        if i == 1:
            own += ["--set", f"store.pages={self.shared}"]
        return super().start_node(i, *own, *extra)


def _source(root: Path) -> dict[str, bytes]:
    return write_small_files(root, seed=5, files=1500, dirs=7, max_size=3000)


def _counters(c: Cluster, want: int) -> dict[str, dict[str, int]]:
    """Each node's counters once n2 has ``want`` pages from peers and n1 served some
    (nodes publish their statistics every 2 s), or after 15 s."""
    deadline = time.monotonic() + 15
    while True:
        status = json.loads(c.ks(["status", "--json"]).stdout)
        counters = {n: s["counters"] for n, s in status["stats"].items()}
        n1, n2 = counters.get("n1", {}), counters.get("n2", {})
        if n2.get("pages_from_peers", 0) >= want and n1.get("pages_served", 0) > 0:
            return counters
        if time.monotonic() > deadline:
            return counters
        time.sleep(0.5)


def _page_files(d: Path) -> set[str]:
    return {p.name for p in d.rglob("*") if p.is_file() and not p.name.endswith(".tmp")}


def _remove_data_pages(copy: Path) -> int:
    """Remove the data pages from ``copy``, keeping the table pages (those that list
    other pages' hashes); how many went."""
    files = {p.name: p for p in copy.rglob("*") if p.is_file() and len(p.name) == 64}
    tables = set()
    for name, p in files.items():
        page = zlib.decompress(p.read_bytes())
        if len(page) % 32 == 0 and all(page[i:i + 32].hex() in files for i in range(0, len(page), 32)):
            tables.add(name)
    for name in set(files) - tables:
        files[name].unlink()
    return len(files) - len(tables)


def test_mounts_read_a_paged_manifest_from_their_nodes_copy_filled_by_peers(tmp_path: Path) -> None:
    src = tmp_path / "source"
    files = _source(src)
    c = PagedCluster(tmp_path / "c", 3)
    try:
        c.start()
        shared = ["--set", f"store.pages={c.shared}", "--set", "store.paged_above=4096"]
        c.ks(["import", str(src), "--name", "paged", "--chunk-size", c.chunk_size, "-q", *shared])
        pages = _page_files(c.shared)
        assert len(pages) >= 4                    # a root over several data pages
        c.ks(["preload", "paged", "--timeout", "60", *shared])
        for i in (1, 2, 3):                      # every node holds every page of the version
            assert _page_files(c.copy(i)) == pages, f"n{i}'s copy"
            assert (c.copy(i).stat().st_mode & 0o777) == 0o700
        counters = _counters(c, len(pages))
        assert counters["n2"]["pages_from_peers"] == len(pages)
        assert counters["n2"]["pages_from_store"] == counters["n3"]["pages_from_store"] == 0
        assert counters["n1"]["pages_served"] > 0

        mnt = c.mount("paged", "--set", f"cluster.page_copy={c.copy(2)}")
        for rel, data in files.items():
            assert (mnt / rel).read_bytes() == data, rel
        c.unmount(mnt)
        library = {"cluster.page_copy": str(c.copy(2)), "store.pages": ""}   # as a mount
        assert library_reads(c, tmp_path, "paged", files, library) == len(files)

        removed = _remove_data_pages(c.copy(2))   # the page map asks n2 for them
        mnt = c.mount("paged", "--set", f"cluster.page_copy={c.copy(2)}")
        for rel, data in files.items():
            assert (mnt / rel).read_bytes() == data, rel
        c.unmount(mnt)
        assert _page_files(c.copy(2)) == pages
        again = _counters(c, len(pages) + removed)
        assert again["n2"]["pages_from_peers"] == len(pages) + removed

        # a version no node preloads: its table pages asked of n2 by the mount, its data
        # pages by the mount's page map, n2 getting each from a peer
        c.ks(["import", str(src / "d3"), "--name", "cold", "--chunk-size", c.chunk_size, "-q",
              *shared])
        cold = {rel[3:]: data for rel, data in files.items() if rel.startswith("d3/")}
        before = _page_files(c.copy(2))
        mnt = c.mount("cold", "--set", f"cluster.page_copy={c.copy(2)}")
        for rel, data in cold.items():
            assert (mnt / rel).read_bytes() == data, rel
        c.unmount(mnt)
        assert _page_files(c.copy(2)) - before == _page_files(c.shared) - pages

        c.kill_node(1)                            # the only node with store.pages
        mnt = c.mount("paged", "--set", f"cluster.page_copy={c.copy(3)}")
        for rel, data in list(files.items())[::7]:
            assert (mnt / rel).read_bytes() == data, rel
        assert sorted(os.listdir(mnt)) == sorted({rel.split("/")[0] for rel in files})
    finally:
        c.close()


def test_a_mount_with_no_copy_and_no_store_pages_fails_with_one_line(tmp_path: Path) -> None:
    src = tmp_path / "source"
    _source(src)
    c = PagedCluster(tmp_path / "c", 1)
    try:
        c.start()
        shared = ["--set", f"store.pages={c.shared}", "--set", "store.paged_above=4096"]
        c.ks(["import", str(src), "--name", "cold", "--chunk-size", c.chunk_size, "-q", *shared])
        mp = c.base / "cold-mnt"
        mp.mkdir()
        r = c.ks(["mount", "cold", str(mp), "--set", f"cluster.page_copy={tmp_path / 'none'}"],
                 check=False)
        assert r.returncode != 0 and not os.path.ismount(mp)
        assert "no page directory is here" in r.stderr and "Traceback" not in r.stderr
    finally:
        c.close()
