"""``kspeedfs stats MOUNTPOINT`` against a real mount: the counters it reads from the
``user.kspeedfs.stats`` xattr move while files are read through the mount, ``--json``
prints one parseable object per sample, the plain form is a header and one line per
sample, and a path that cannot be watched is one line of error."""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from bench.system import unmount
from tests.fixtures.mounts import CHUNK, KSPEEDFS, Cluster1, daemon_pid, kspeedfs

FILES = 64


@pytest.fixture(scope="module")
def mounted(tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("stats")
    src = base / "src"
    src.mkdir()
    rnd = random.Random(3)
    for i in range(FILES):
        (src / f"f{i:03d}.bin").write_bytes(rnd.randbytes(CHUNK // 2 + i))
    c = Cluster1(base)
    c.import_(src, "st")
    mnt = c.mount("st")                   # with fuse.xattrs=true, as every test mount
    try:
        yield c, src, mnt
    finally:
        c.close()


def read_until_done(mnt: Path, proc: subprocess.Popen[str]) -> int:
    """Read every file of the mount, again and again, until ``proc`` exits; the page
    cache is dropped after each file so each pass reaches the daemon. Returns bytes read."""
    total = 0
    while proc.poll() is None:
        for i in range(FILES):
            fd = os.open(mnt / f"f{i:03d}.bin", os.O_RDONLY)
            try:
                while chunk := os.read(fd, 1 << 20):
                    total += len(chunk)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return total


def watch(mnt: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], int]:
    proc = subprocess.Popen([*KSPEEDFS, "stats", str(mnt), "--interval", "0.2", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        nbytes = read_until_done(mnt, proc)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), nbytes


def test_json_samples_show_the_reads_made_while_watching(mounted) -> None:
    c, src, mnt = mounted
    before = json.loads(os.getxattr(mnt, "user.kspeedfs.stats"))
    r, nbytes = watch(mnt, "--count", "3", "--json")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    samples = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(samples) == 3 and nbytes > 0
    assert all(0.1 < s["interval"] < 2.0 for s in samples), samples
    totals = [s["totals"]["read_bytes"] for s in samples]
    assert before["read_bytes"] <= totals[0] <= totals[1] <= totals[2]
    assert totals[2] > before["read_bytes"]
    assert sum(s["reads_per_s"] for s in samples) > 0
    assert sum(s["read_mb_per_s"] for s in samples) > 0
    assert sum(s["ops_per_s"] for s in samples) > 0
    assert set(samples[0]["tiers"]) == {"memory", "disk", "peer", "source"}
    assert "peer" not in samples[0]                 # a mount without a cluster
    after = json.loads(os.getxattr(mnt, "user.kspeedfs.stats"))
    assert after["read_bytes"] >= totals[2] and after["ops"]["read"] > 0   # per-op counts too


def test_plain_output_is_a_header_and_one_line_per_sample(mounted) -> None:
    c, src, mnt = mounted
    r, _ = watch(mnt, "--count", "2")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 3 and lines[0].split()[:4] == ["TIME", "OPS/S", "READS/S", "MB/S"]
    assert all(len(line.split()) == len(lines[0].split()) for line in lines[1:]), lines
    assert "\x1b" not in r.stdout and "\r" not in r.stdout
    assert any(float(line.split()[2].replace(",", "")) > 0 for line in lines[1:]), lines


def test_a_path_that_is_not_a_mount_is_one_line_of_error(mounted, tmp_path: Path) -> None:
    c, src, _ = mounted
    r = kspeedfs(["stats", str(src), "--count", "1"], check=False)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.splitlines() == [f"kspeedfs stats: error: {src} is not a kspeedfs mount"]
    r = kspeedfs(["stats", str(tmp_path / "missing")], check=False)
    assert r.returncode == 1 and len(r.stderr.splitlines()) == 1 and "no such directory" in r.stderr


def test_a_default_mount_without_xattrs_shows_its_counters(mounted) -> None:
    """Read over the daemon's control socket (root-only), as README's ``kspeedfs stats``
    after a plain ``kspeedfs mount``."""
    c, _, _ = mounted
    mnt = c.mount("st", None, "--set", "fuse.xattrs=false")
    with pytest.raises(OSError):
        os.getxattr(mnt, "user.kspeedfs.stats")
    r, nbytes = watch(mnt, "--count", "2", "--json")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    samples = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(samples) == 2 and nbytes > 0
    assert samples[1]["totals"]["read_bytes"] > 0 and sum(s["reads_per_s"] for s in samples) > 0
    assert samples[1]["memory_bytes"] > 0 and samples[1]["transport"]


def test_a_mount_neither_the_socket_nor_xattrs_reach_is_one_line_of_error(mounted) -> None:
    """Not root (the control socket is root-only) and no fuse.xattrs: one line that says
    both ways in."""
    c, _, _ = mounted
    base = Path(tempfile.mkdtemp(prefix="kspeedfs-stats-"))     # pytest's tmp is root-only
    try:
        os.chmod(base, 0o755)
        mnt = c.mount("st", base / "m", "--set", "fuse.xattrs=false",
                      "--set", "fuse.allow_other=true")
        r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                            *KSPEEDFS, "stats", str(mnt), "--count", "1"],
                           capture_output=True, text=True, timeout=60, cwd="/")
        assert r.returncode == 1 and "Traceback" not in r.stderr
        assert len(r.stderr.splitlines()) == 1 and "root-only" in r.stderr, r.stderr
        assert "--set fuse.xattrs=true" in r.stderr and "run as root" in r.stderr, r.stderr
    finally:
        unmount(base / "m", daemon_pid(base / "m"))
        shutil.rmtree(base, ignore_errors=True)
