"""Mounts of a paged manifest (``manifest/pages.py``): made by ``kspeedfs migrate`` from a
whole one, read through the kernel by both engines, with memory for what is touched."""
from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from tests.fixtures.mounts import Cluster1, assert_same_tree, kspeedfs, make_tree


@pytest.fixture(scope="module")
def paged(tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("paged")
    src = make_tree(base / "src")
    c = Cluster1(base)
    c.import_(src, "edge")
    out = kspeedfs(["migrate", "edge", *c.common()]).stdout
    assert out.startswith("migrated edge@1 to edge@2: pages of "), out
    try:
        yield c, src, c.mount("edge")
    finally:
        c.close()


def test_a_paged_manifest_mounts_byte_exact(paged) -> None:
    c, src, mnt = paged
    assert_same_tree(src, mnt)
    assert "mapped as" in c.log_text()         # paged on touch, not read whole


def test_directories_count_their_subdirectories_in_nlink(paged) -> None:
    _, src, mnt = paged
    for dirpath, dirs, _ in os.walk(src):
        rel = os.path.relpath(dirpath, src)
        assert os.stat(mnt / rel).st_nlink == 2 + len(dirs), rel


def test_the_pyfuse3_engine_reads_a_paged_manifest(paged) -> None:
    c, src, _ = paged
    mnt = c.mount("edge", None, "--set", "fuse.engine=pyfuse3")
    assert_same_tree(src, mnt)
    top = sum(1 for p in src.iterdir() if p.is_dir() and not p.is_symlink())
    assert os.stat(mnt).st_nlink == 2 + top


def test_migrating_a_paged_version_again_is_one_line(paged) -> None:
    c, _, _ = paged
    proc = kspeedfs(["migrate", "edge", *c.common()], check=False)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        "kspeedfs migrate: error: edge@2 is paged already"], proc.stderr


def test_a_mount_of_the_whole_version_still_works(paged) -> None:
    c, src, _ = paged
    mnt = c.mount("edge", None, "--version", "1")
    assert_same_tree(src, mnt)
    assert Path(mnt).stat().st_nlink >= 2


@pytest.mark.parametrize("engine", ["native", "pyfuse3"])
def test_a_lost_page_fails_the_mount_closed(tmp_path: Path, engine: str) -> None:
    from kspeedfs.manifest.pages import Root, page_path, read_table

    src = tmp_path / "src"
    for d in range(20):
        (src / f"d{d:02d}").mkdir(parents=True)
        for f in range(100):
            (src / f"d{d:02d}" / f"f{f:03d}").write_bytes(b"%d" % f * 40)
    c = Cluster1(tmp_path)
    try:
        c.import_(src, "lost")
        kspeedfs(["migrate", "lost", *c.common()])
        pages = str(c.store / "pages")
        root = Root.parse((c.store / "lost" / "v2.manifest").read_bytes())
        assert root.pages >= 3
        last = read_table(root, [pages])[-32:]      # the digests' page: reads need it
        os.unlink(page_path(pages, last))
        mnt = c.mount("lost", None, "--set", f"fuse.engine={engine}")
        with pytest.raises(OSError) as read:
            (mnt / "d19" / "f099").read_bytes()
        assert read.value.errno == errno.EIO
        with pytest.raises(OSError) as stat:        # never stat'ed: the daemon answers
            os.stat(mnt / "d07" / "f050")
        assert stat.value.errno == errno.EIO
        assert last.hex() in c.log_text()
    finally:
        c.close()
