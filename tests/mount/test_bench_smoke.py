"""The benchmark suite still runs end to end (slow lane: ``--run-slow``).

One workload in ``--quick`` mode against every target, then the JSON is checked for
*shape* - every target measured, the ratios against the baselines present and
positive - never for a figure: benchmarks print numbers, tests do not time things.
Also checks that nothing is left mounted afterwards.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures import netns

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _fuse_mounts_below(root: Path) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f if line.split()[4].startswith(str(root))]


@pytest.mark.skipif(os.geteuid() != 0, reason="drops the page cache and mounts FUSE: needs root")
def test_quick_imagenet_reports_ratios(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--workload", "imagenet", "--reps", "1",
         "--workdir", str(tmp_path / "work"), "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=540,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not _fuse_mounts_below(tmp_path), "the suite left mounts behind"

    data = json.loads((out / "results.json").read_text())
    assert not data["errors"]
    (row,) = [r for r in data["summary"] if r["workload"] == "imagenet"]
    assert set(row["targets"]) == {"source-cold", "source-warm", "kspeedfs-cold", "kspeedfs-warm",
                                   "pyfuse3:kspeedfs-cold", "pyfuse3:kspeedfs-warm",
                                   "io_uring:kspeedfs-warm", "ramfs-py", "ramfs-c", "ramfs-c-mt"}
    for pair in ("kspeedfs-cold / source-cold", "kspeedfs-warm / source-warm",
                 "kspeedfs-warm / ramfs-py", "kspeedfs-warm / ramfs-c", "ramfs-py / ramfs-c",
                 "kspeedfs-warm / pyfuse3:kspeedfs-warm", "kspeedfs-cold / pyfuse3:kspeedfs-cold",
                 "kspeedfs-warm / ramfs-c-mt"):
        assert row["ratios"][pair]["median"] > 0, pair
    # the warm kspeedfs target really was warm: served from its chunk cache, not the source
    warm = [r for r in data["runs"] if r["target"] == "kspeedfs-warm"]
    assert warm and all(r["kspeedfs"]["source_loads"] == 0 for r in warm)
    # the daemon's main thread (the trio loop) is measured apart from the whole daemon
    for r in warm:
        assert 0 <= r["figures"]["daemon_main_cpu_us_per_op"] <= r["figures"]["daemon_cpu_us_per_op"]
    assert "ratio kspeedfs-warm / ramfs-py" in proc.stdout          # the table was printed
    assert (out / "results.txt").exists() and (out / "ratios.md").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="makes network namespaces: needs root")
def test_quick_transport_reports_soft_over_tcp(tmp_path: Path) -> None:
    """The soft-vs-TCP baseline runs between two netns hosts (~10 s) and leaves none behind."""
    out = tmp_path / "out"
    before = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--workload", "transport", "--reps", "1",
         "--workdir", str(tmp_path / "work"), "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "results.json").read_text())
    assert not data["errors"]
    (row,) = [r for r in data["summary"] if r["workload"] == "transport"]
    assert set(row["targets"]) == {"soft", "tcp"}
    assert row["ratios"]["soft / tcp"]["median"] > 0
    assert all(r["figures"]["client_cpu_s_per_gb"] > 0 for r in data["runs"])
    after = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
    # other test runs may make namespaces meanwhile: a new one must belong to a live owner
    records = netns._records()
    runs = {ns.split("-", 1)[0] for ns in after - before if ns.startswith(netns.PREFIX)}
    orphans = {r for r in runs if not (r in records and netns._record_alive(records[r]))}
    assert not orphans, f"the suite left namespaces behind: {orphans}"
