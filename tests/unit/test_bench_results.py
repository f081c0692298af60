"""The suite's summaries: per-rep ratios, and the peer-read CPU figure without NIC threads."""
from __future__ import annotations

import pytest

from bench.results import Results, Run
from bench.system import role_key


def _run(target: str, rep: int, mbs: float, cpu: float, nic: float | None = None) -> Run:
    figures = {"MB/s": mbs, "daemon_cpu_s_per_GB": cpu}
    if nic is not None:
        figures["daemon_nic_cpu_s_per_GB"] = nic
    return Run("cluster", "seq", target, rep, "MB/s", figures)


def test_cpu_ratio_without_nic_threads_is_taken_per_rep() -> None:
    runs = [_run("peers", 0, 100, 0.60, 0.25), _run("ramfs-c", 0, 300, 0.20),
            _run("peers", 1, 120, 0.50, 0.20), _run("ramfs-c", 1, 310, 0.25),
            _run("peers", 2, 110, 0.55, 0.19), _run("ramfs-c", 2, 290, 0.24)]
    res = Results(meta={}, runs=runs, ratio_pairs={"cluster": [("peers", "ramfs-c")]})
    (row,) = res.summary()
    cpu = row["cpu_ratios"]["peers / ramfs-c"]
    assert cpu["n"] == 3
    assert (cpu["min"], cpu["median"], cpu["max"]) == pytest.approx((0.30 / 0.25, 0.36 / 0.24,
                                                                     0.35 / 0.20))
    assert "CPU-s/GB without NIC threads, peers / ramfs-c" in res.table()


def test_no_cpu_ratio_where_the_first_target_reports_no_nic_threads() -> None:
    runs = [_run("a", 0, 100, 0.6), _run("b", 0, 200, 0.3)]
    res = Results(meta={}, runs=runs, ratio_pairs={"cluster": [("a", "b")]})
    (row,) = res.summary()
    assert row["ratios"]["a / b"]["median"] == 0.5 and row["cpu_ratios"] == {}
    assert "without NIC" not in res.table()


def test_the_native_threads_cpu_is_printed_by_role() -> None:
    """Beside the soft NIC and the main thread, the request threads' and the fetch
    thread's CPU per GB (``system.ROLE_THREADS``), medians over the reps."""
    runs = []
    for rep, (fuse, fetch) in enumerate(((0.20, 0.10), (0.18, 0.12), (0.22, 0.11))):
        r = _run("peers", rep, 100, 0.6, 0.2)
        r.figures[role_key("request threads")] = fuse
        r.figures[role_key("fetch")] = fetch
        runs += [r, _run("ramfs-c", rep, 300, 0.2)]
    res = Results(meta={}, runs=runs, ratio_pairs={"cluster": [("peers", "ramfs-c")]})
    (row,) = res.summary()
    assert row["targets"]["peers"][role_key("fetch")] == pytest.approx(0.11)
    assert "(soft NIC 0.20, request threads 0.20, fetch 0.11)" in res.table()
    assert "request threads" not in res.table().split("ramfs-c")[1]
