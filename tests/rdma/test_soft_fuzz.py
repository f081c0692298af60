"""The soft engine's wire parsing under a fuzzer: native/fuzz/fuzz_engine.c, built with
AddressSanitizer + UBSan, drives ks_hdr_parse, ks_hello_parse and the engine's own
connection handlers (HELLO routing, responder, requester) with mutated frames.  Any
out-of-bounds access, use-after-free, leak, undefined behaviour or broken invariant
makes it exit non-zero.  The default lane runs it for a few seconds (~300k inputs on
this 2-core machine); the slow lane for a minute."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures import fuzz


@pytest.fixture(scope="module")
def fuzzer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fuzz.build([fuzz.NATIVE / "fuzz" / "fuzz_engine.c"],
                      tmp_path_factory.mktemp("fuzz") / "fuzz_engine",
                      ["-DKS_NO_PYTHON", "-Wno-unused-function"])


def test_fuzz_engine_parsers_briefly(fuzzer: Path) -> None:
    assert " 0 inputs" not in fuzz.run(fuzzer, 3)


@pytest.mark.slow
def test_fuzz_engine_parsers_for_a_minute(fuzzer: Path) -> None:
    fuzz.run(fuzzer, 60)
