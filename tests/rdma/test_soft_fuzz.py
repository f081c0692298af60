"""The soft engine's wire parsing under a fuzzer: native/fuzz/fuzz_engine.c, built with
AddressSanitizer + UBSan, drives ks_hdr_parse, ks_hello_parse and the engine's own
connection handlers (HELLO routing, responder, requester) with mutated frames.  Any
out-of-bounds access, use-after-free, leak, undefined behaviour or broken invariant
makes it exit non-zero.  The default lane runs it for a few seconds (~300k inputs on
this 2-core machine); the slow lane for a minute."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "native" / "fuzz" / "fuzz_engine.c"
CFLAGS = ["-g", "-O1", "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
          "-DKS_NO_PYTHON", "-Wall", "-Wextra", "-Werror", "-Wno-unused-parameter",
          "-Wno-unused-function"]


@pytest.fixture(scope="module")
def fuzzer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    out = tmp_path_factory.mktemp("fuzz") / "fuzz_engine"
    build = subprocess.run([cc, *CFLAGS, f"-I{ROOT / 'native'}", str(SOURCE), "-o", str(out),
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
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    assert "no failure" in res.stdout
    return res.stdout


def test_fuzz_engine_parsers_briefly(fuzzer: Path) -> None:
    out = _run(fuzzer, 3, seed=int.from_bytes(os.urandom(4), "little") or 1)
    assert " 0 inputs" not in out


@pytest.mark.slow
def test_fuzz_engine_parsers_for_a_minute(fuzzer: Path) -> None:
    _run(fuzzer, 60, seed=int.from_bytes(os.urandom(4), "little") or 1)
