"""fio with the job files shipped in bench/fio/ runs against a mount (a smoke test, not a
benchmark: it asserts that fio reads what it should without errors, not how fast)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.fixtures.mounts import cluster1

JOBS = Path(__file__).resolve().parents[2] / "bench" / "fio"
pytestmark = pytest.mark.skipif(shutil.which("fio") is None, reason="fio not installed")


@pytest.mark.parametrize("job", ["seq-1m.fio", "rand-4k.fio"])
def test_fio_job_on_mount(tmp_path: Path, job: str) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(2):
        (src / f"shard{i}.bin").write_bytes(os.urandom(24 << 20))
    with cluster1(tmp_path) as c:
        c.import_(src, "fio")
        mnt = c.mount("fio")
        env = dict(os.environ, FILES=":".join(str(mnt / f"shard{i}.bin") for i in range(2)),
                   SIZE="16m", JOBS="2", RUNTIME="2")
        r = subprocess.run(["fio", "--readonly", "--output-format=json", str(JOBS / job)],
                           capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout[r.stdout.index("{"):])
        job_result = out["jobs"][0]
        assert job_result["error"] == 0
        assert job_result["read"]["io_bytes"] >= 16 << 20
        assert job_result["write"]["io_bytes"] == 0
        stats = json.loads(os.getxattr(mnt, "user.kspeedfs.stats"))
        assert stats["read_bytes"] > 0 and stats["source_mismatches"] == 0
