"""The native FUSE engine under a fuzzer: native/fuzz/fuzz_fuse_engine.c, built with
AddressSanitizer + UBSan, plays the kernel (random requests on a SOCK_SEQPACKET pair,
every reply header checked) and Python (queued misses answered, tier buffers put,
discarded and freed while the request thread replies from them) over random, often
corrupt, manifest indexes. Any out-of-bounds read, use-after-free, leak or undefined
behaviour makes it exit non-zero. The default lane runs it for a few seconds (~200
engines, ~50k requests here); the slow lane for a minute."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "native" / "fuzz" / "fuzz_fuse_engine.c", ROOT / "native" / "fuse_engine.c"]
CFLAGS = ["-g", "-O1", "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
          "-Wall", "-Wextra", "-Werror", "-Wno-unused-parameter"]


@pytest.fixture(scope="module")
def fuzzer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    out = tmp_path_factory.mktemp("fuzz") / "fuzz_fuse_engine"
    build = subprocess.run([cc, *CFLAGS, f"-I{ROOT / 'native'}", *map(str, SOURCES), "-o", str(out),
                            "-lpthread"], capture_output=True, text=True)
    if build.returncode != 0 and "asan" in build.stderr.lower():
        pytest.skip(f"no sanitizer runtime: {build.stderr[-300:]}")
    assert build.returncode == 0, build.stderr
    return out


def _run(fuzzer: Path, seconds: float, seed: int) -> str:
    env = {**os.environ, "ASAN_OPTIONS": "detect_leaks=1:abort_on_error=0",
           "UBSAN_OPTIONS": "print_stacktrace=1"}
    res = subprocess.run([str(fuzzer), "-seconds", str(seconds), "-seed", str(seed)],
                         capture_output=True, text=True, timeout=seconds + 60, env=env)
    assert res.returncode == 0, f"seed {seed}:\n" + (res.stdout + res.stderr)[-4000:]
    assert "no failure" in res.stdout
    return res.stdout


def test_fuse_engine_survives_random_requests_indexes_and_tier_races(fuzzer: Path) -> None:
    out = _run(fuzzer, 3, seed=int.from_bytes(os.urandom(4), "little") or 1)
    assert not out.startswith("0 cases")


@pytest.mark.slow
def test_fuse_engine_fuzz_for_a_minute(fuzzer: Path) -> None:
    _run(fuzzer, 60, seed=int.from_bytes(os.urandom(4), "little") or 1)
