"""The native FUSE engine under a fuzzer: native/fuzz/fuzz_fuse_engine.c, built with
AddressSanitizer + UBSan, plays the kernel (random requests on a SOCK_SEQPACKET pair,
every reply header checked) and Python (queued misses answered, tier buffers put,
discarded and freed while the request thread replies from them) over random, often
corrupt, manifest indexes; and lays out random FUSE io_uring entries whose sizes lie
(``fe_ring_layout``). Any out-of-bounds read, use-after-free, leak or undefined
behaviour makes it exit non-zero. The default lane runs it for a few seconds (~200
engines, ~50k requests here); the slow lane for a minute."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures import fuzz


@pytest.fixture(scope="module")
def fuzzer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    engine = ["fuse_engine.c", "fuse_mount.c", "fuse_reply.c", "fuse_ops.c", "fuse_read.c",
              "fuse_queue.c", "fuse_uring.c", "fuse_threads.c", "fuse_tier.c", "fuse_fetch.c",
              "fetch_read.c", "fuse_xxh.c", "fuse_xxh_avx2.c"]
    return fuzz.build([fuzz.NATIVE / "fuzz" / "fuzz_fuse_engine.c",
                       *(fuzz.NATIVE / f for f in engine)],
                      tmp_path_factory.mktemp("fuzz") / "fuzz_fuse_engine", ["-luring"])


def test_fuse_engine_survives_random_requests_indexes_and_tier_races(fuzzer: Path) -> None:
    out = fuzz.run(fuzzer, 3)
    assert not out.startswith("0 cases") and " 0 ring layouts" not in out


@pytest.mark.slow
def test_fuse_engine_fuzz_for_a_minute(fuzzer: Path) -> None:
    fuzz.run(fuzzer, 60)
