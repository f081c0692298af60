"""The benchmark suite's one entry point: ``python -m bench [--quick] [--workload NAME ...]``.

For each workload: make (or reuse) its deterministic dataset, import it into
kspeedfs, build and mount the baselines, then for every case run every target
*interleaved* - A, B, C, A, B, C ... for ``reps`` repetitions - each target put in
its state just before its run (page cache dropped for the cold and FUSE targets, a
fresh mount for kspeedfs-cold). Report medians and per-repetition ratios; write
results.json, results.txt, ratios.md and one PNG per workload to ``--out``.

Mounts are always removed: every mount is registered the moment it exists and a
``finally`` unmounts them (SIGTERM is turned into the same path as Ctrl-C).
Benchmarks are not tests: nothing here asserts a figure.
"""
from __future__ import annotations

import argparse
import datetime
import logging
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

from . import workloads as W
from .datasets import Dataset
from .results import Results, Run
from .system import (
    MAIN_THREAD,
    REPO,
    ROLE_THREADS,
    Mounts,
    fresh_memory_rate,
    machine_cpu,
    mem_available,
    nic_seconds,
    process_cpu,
    role_key,
    thread_cpu,
)
from .targets import Target, build_ramfs_c, fuse_knobs

log = logging.getLogger("bench")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes, 2 repetitions (< 3 min): a smoke check")
    p.add_argument("--scale", choices=list(W.SCALES),
                   help="dataset sizes (default: full, or quick with --quick)")
    p.add_argument("--workload", "-w", action="append", default=[],
                   help=f"workload or group (repeatable); known: {', '.join([*W.WORKLOADS, *W.GROUPS])}")
    p.add_argument("--reps", type=int, help="repetitions of each interleaved round (default per scale)")
    p.add_argument("--imagenet-files", type=int, help="override the ImageNet-like file count")
    p.add_argument("--seq-size", type=str, help="override the size of each seq.N file (e.g. 512MiB)")
    p.add_argument("--runtime", type=int, help="override the time-based fio runtime, s")
    p.add_argument("--workdir", default="/tmp/kspeedfs-bench", help="datasets, stores, mounts, logs")
    p.add_argument("--out", help="results directory (default WORKDIR/results/<timestamp>)")
    p.add_argument("--no-c", action="store_true", help="skip the C libfuse ceiling")
    p.add_argument("--target", "-t", action="append", default=[], metavar="NAME",
                   help="run only these targets (repeatable), e.g. -t kspeedfs-warm "
                        "-t io_uring:kspeedfs-warm -t ramfs-c; default: every target")
    p.add_argument("--cluster-chunk-size", default="4MiB", metavar="SIZE",
                   help="import.chunk_size (and node slot size) of the cluster workloads' dataset")
    p.add_argument("--ab-tree", metavar="DIR",
                   help="A/B: also mount kspeedfs from the tree in DIR (DIR/kspeedfs/...) as targets "
                        "B:kspeedfs-cold/-warm (the cluster workload: B:kspeedfs-peers), interleaved "
                        "with the others; ratios B / A (both trees mount one store: they must read "
                        "the same manifest format)")
    p.add_argument("--kspeedfs-rev", metavar="REV",
                   help="benchmark kspeedfs as committed at REV (git archive into WORKDIR), "
                        "not the working tree: a stable subject while others edit the checkout "
                        "(single-node targets only: the transport and cluster workloads run "
                        "the checkout's nodes and mounts; results.json says so)")
    p.add_argument("--kspeedfs-tree", metavar="DIR",
                   help="benchmark the kspeedfs package found in DIR (DIR/kspeedfs/...), e.g. a "
                        "patched copy, to measure a proposed fix against the same baselines")
    p.add_argument("--list", action="store_true", help="list the workloads and exit")
    p.add_argument("-v", "--verbose", action="store_true")
    return p.parse_args(argv)


def _meta(args: argparse.Namespace, scale: W.Scale, names: list[str]) -> dict:
    def sh(*cmd: str) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO).stdout.strip()
        except OSError:
            return ""
    knobs = fuse_knobs()
    return {
        "command": " ".join([os.path.basename(sys.executable), "-m", "bench", *sys.argv[1:]]),
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "scale": scale.name, "reps": scale.reps, "sizes": scale.__dict__, "workloads": names,
        "git": sh("git", "rev-parse", "--short", "HEAD"), "kernel": platform.release(),
        "kspeedfs": args.kspeedfs_tree or args.kspeedfs_rev or "working tree", "ab_tree": args.ab_tree,
        # netns nodes and mounts run `python -m kspeedfs.cli.app` from the checkout
        "cluster_kspeedfs": "working tree " + sh("git", "describe", "--always", "--dirty"),
        "cluster_chunk_size": args.cluster_chunk_size,
        "cpus": os.cpu_count(),
        "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "fio": sh("fio", "--version"), "fuse_knobs": knobs.__dict__,
    }


def snapshot(rev: str, work: Path) -> Path:
    """``git archive REV kspeedfs`` into WORKDIR/subject-<sha>; returns the directory."""
    sha = subprocess.run(["git", "rev-parse", "--short", rev], capture_output=True, text=True,
                         cwd=REPO, check=True).stdout.strip()
    dest = work / f"subject-{sha}"
    if not (dest / "kspeedfs" / "__init__.py").exists():
        dest.mkdir(parents=True, exist_ok=True)
        arch = subprocess.run(["git", "archive", sha, "kspeedfs"], capture_output=True, cwd=REPO, check=True)
        subprocess.run(["tar", "-x", "-C", str(dest)], input=arch.stdout, check=True)
    return dest


def _check_memory(name: str, ds: Dataset, targets: list[Target], results: Results) -> None:
    """Warn when the targets' RAM copies of the dataset plus the page cache a run fills
    do not fit: reclaim then costs the FUSE daemons CPU and evicts what the cold
    targets just read, and the figures measure the machine's memory, not the targets
    (the first full-scale run: 4 GiB datasets held by ramfs-py, ramfs-c and two
    kspeedfs mounts on 23 GiB; kspeedfs-cold j4 read 147 MB/s there, 1.7 GB/s alone)."""
    copies = sum(1 for t in targets if t.holds_dataset) + 2    # + source and mount page cache
    need, have = copies * ds.bytes, mem_available()
    if have and need > 0.9 * have:
        msg = (f"{name}: {copies} copies of the {ds.bytes / 1e9:.1f} GB dataset ({need / 1e9:.1f} GB: "
               f"RAM-held targets and the page cache) against {have / 1e9:.1f} GB available: "
               f"reclaim will distort the figures, cold ones most (smaller --scale or --seq-size, "
               f"or --no-c)")
        log.warning(msg)
        print(f"   WARNING {msg}", flush=True)
        results.meta.setdefault("warnings", []).append(msg)


def _nic_cpu(pids: list[int]) -> dict[int, float]:
    """CPU seconds of the soft NIC threads (``NIC_THREADS``) of each live process."""
    out = {}
    for pid in pids:
        threads = thread_cpu(pid)
        if threads:
            out[pid] = nic_seconds(threads)
    return out


def _warm_up(name: str, case: W.Case, targets: list[Target]) -> None:
    """``case`` run once on every target, not recorded: the first runs after the
    targets' setup fill page cache and buffers from memory the VM has not backed since it
    was idle, and measured that more than the targets (docs/benchmarks.md, "Peers
    against one warm machine")."""
    t0 = time.monotonic()
    for t in targets:
        try:
            t.prepare()
            case.run(t.path)
        except Exception as e:       # the measured runs record it, if it happens again
            log.warning("%s/%s warm-up on %s: %s", name, case.name, t.name, e)
        finally:
            t.finish()
    print(f"   warm-up: {case.name} once on each target, not recorded "
          f"({time.monotonic() - t0:.0f}s)", flush=True)


#: below this (GB/s of first touches) cold figures measure the VM's memory backing
FRESH_MEMORY_WARN = 0.5


def _check_fresh_memory(name: str, results: Results) -> None:
    """Record how fast never-touched memory is, with every target of the workload set up
    (``system.fresh_memory_rate``), and warn when it is slow: then a cold target's
    figure depends on how much memory the others hold. A time-based shards run here gave
    kspeedfs-cold 0.5 or 3.9 GB/s depending on that alone."""
    rate = fresh_memory_rate()
    results.meta.setdefault("fresh_memory_GBps", {})[name] = round(rate, 3)
    print(f"   fresh memory: {rate:.2f} GB/s (first touches, 128 MiB)", flush=True)
    if rate < FRESH_MEMORY_WARN:
        msg = (f"{name}: never-touched memory is slow here ({rate:.2f} GB/s): cold targets, "
               f"which fill their caches during the run, measure the machine's memory backing "
               f"as much as themselves")
        log.warning(msg)
        print(f"   WARNING {msg}", flush=True)
        results.meta.setdefault("warnings", []).append(msg)


def _ops(figures: dict) -> float:
    """The operations a run's reader issued, where it counts them: files read whole or
    stat'ed, records, ls entries, fio's I/Os (its read calls; 0 when unknown). Not FUSE
    requests: one op can be several READs (a whole file, readahead) or none (a cache hit)."""
    for k in ("files", "records", "entries", "ios"):
        if figures.get(k):
            return float(figures[k])
    return 0.0


def run_workload(wl: W.Workload, ctx: W.Context, results: Results) -> None:
    t0 = time.monotonic()
    if wl.needs:
        wl.needs()
    ds = wl.dataset(ctx)
    print(f"\n== {wl.name}: {wl.doc}\n   dataset {ds.root} ({ds.files:,} files, {ds.bytes / 1e6:,.0f} MB)",
          flush=True)
    targets = wl.targets(ds, ctx)
    if ctx.only:
        targets = [t for t in targets if t.name in ctx.only]
    names = [t.name for t in targets]
    _check_memory(wl.name, ds, targets, results)
    sweep_ratios = getattr(wl, "sweep_ratios", None)
    results.ratio_pairs[wl.name] = sweep_ratios(names) if sweep_ratios else \
        [(a, b) for a, b in wl.ratios if a in names and b in names]
    mounts = Mounts()
    try:
        for t in targets:
            t.setup(mounts, ctx.work)
        print(f"   set up {', '.join(names)} in {time.monotonic() - t0:.0f}s", flush=True)
        _check_fresh_memory(wl.name, results)
        cases = wl.cases(ds, ctx)
        cases = cases[:ctx.scale.max_cases] if ctx.scale.max_cases else cases
        if cases:
            _warm_up(wl.name, cases[0], targets)
        for case in cases:
            for rep in range(ctx.scale.reps):
                for t in targets:
                    try:
                        t.prepare()
                        before = t.stats()
                        pid = t.daemon()
                        threads0 = thread_cpu(pid)
                        peers0 = _nic_cpu(t.peers())
                        cpu0, host0, wall0 = process_cpu(pid), machine_cpu(), time.monotonic()
                        figures = case.run(t.path)
                        cpu1, host1, wall = process_cpu(pid), machine_cpu(), time.monotonic() - wall0
                        threads1 = thread_cpu(pid)
                        peers1 = _nic_cpu(t.peers())
                        # the whole machine: what a target costs beyond its own daemon
                        # (peers, the network stack, the readers) shows up here
                        if figures.get("bytes"):
                            gb = figures["bytes"] / 1e9
                            figures["host_cpu_s_per_GB"] = (host1 - host0) / gb
                            if peers1:
                                figures["peers_nic_cpu_s_per_GB"] = sum(
                                    v - peers0.get(p, 0.0) for p, v in peers1.items()) / gb
                        if cpu0 is not None and cpu1 is not None:
                            # the daemon's share of the machine while the case ran (on 2
                            # vCPUs its cost is what the readers compete with); 10 ms ticks,
                            # so short --quick runs give coarse figures
                            cpu = cpu1 - cpu0
                            figures["daemon_cpu_%"] = 100 * cpu / (figures.get("seconds") or wall)
                            # the main thread alone: what one core caps (the trio loop)
                            main = threads1.get(MAIN_THREAD, 0.0) - threads0.get(MAIN_THREAD, 0.0)
                            if figures.get("bytes"):
                                figures["daemon_cpu_s_per_GB"] = cpu / gb
                                figures["daemon_main_cpu_s_per_GB"] = main / gb
                                # the soft provider's share: a NIC's work on RDMA hardware
                                # (threads that ended during the case are not counted)
                                nic = nic_seconds(threads1) - nic_seconds(threads0)
                                if nic > 0:
                                    figures["daemon_nic_cpu_s_per_GB"] = nic / gb
                                for role, names in ROLE_THREADS.items():
                                    used = sum(threads1.get(n, 0.0) - threads0.get(n, 0.0)
                                               for n in names)
                                    if used > 0:
                                        figures[role_key(role)] = used / gb
                            if ops := _ops(figures):
                                figures["daemon_cpu_us_per_op"] = 1e6 * cpu / ops
                                figures["daemon_main_cpu_us_per_op"] = 1e6 * main / ops
                    except Exception as e:       # record, go on: one broken target is a finding
                        log.error("%s/%s on %s: %s", wl.name, case.name, t.name, e)
                        results.errors.append({"workload": wl.name, "case": case.name, "target": t.name,
                                               "rep": rep, "error": str(e)})
                        t.finish()
                        continue
                    after = t.stats()
                    t.finish()
                    delta = ({k: after[k] - before.get(k, 0) for k in after
                              if isinstance(after[k], (int, float))} if before and after else None)
                    results.runs.append(Run(wl.name, case.name, t.name, rep, case.primary, figures, delta))
                    also = "".join(f"  {k} {figures[k]:.3g}" for k in (*case.also, "daemon_cpu_%")
                                   if figures.get(k) is not None)
                    print(f"   {case.name:<22} rep {rep}  {t.name:<30} {figures[case.primary]:>12,.1f} "
                          f"{case.primary}{also}", flush=True)
                    if figures.get("errors"):        # a reader that counts its failures, not raises
                        results.errors.append({"workload": wl.name, "case": case.name, "target": t.name,
                                               "rep": rep, "error": f"{figures['errors']} read errors"})
    finally:
        mounts.close()
        for t in targets:           # test-beds (netns hosts, clusters) a target started
            close = getattr(t, "close", None)
            if close:
                try:
                    close()
                except Exception as e:
                    log.error("%s: closing %s: %s", wl.name, t.name, e)
    print(f"   {wl.name} done in {time.monotonic() - t0:.0f}s", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.list:
        for name, wl in W.WORKLOADS.items():
            print(f"{name:<24} {wl.doc}")
        for g, members in W.GROUPS.items():
            print(f"{g:<24} = {' '.join(members)}")
        return 0
    work = Path(args.workdir).resolve()
    (work / "log").mkdir(parents=True, exist_ok=True)
    out = Path(args.out) if args.out else \
        work / "results" / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    subject = (Path(args.kspeedfs_tree).resolve() if args.kspeedfs_tree else
               snapshot(args.kspeedfs_rev, work) if args.kspeedfs_rev else REPO)
    sys.path.insert(0, str(subject))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(subject), str(REPO),
                                                             os.environ.get("PYTHONPATH")]))

    from kspeedfs.config import parse_size

    scale = W.SCALES[args.scale or ("quick" if args.quick else "full")]
    scale = W.scale_with(scale, reps=args.reps or 0, imagenet_files=args.imagenet_files or 0,
                         runtime=args.runtime or 0,
                         seq_size=parse_size(args.seq_size) if args.seq_size else 0)
    names = W.expand(args.workload or (W.DEFAULT_QUICK if scale.name == "quick" else W.DEFAULT_FULL))
    if (args.kspeedfs_rev or args.kspeedfs_tree) and set(names) & set(W.GROUPS["cluster-all"]):
        log.warning("--kspeedfs-rev/--kspeedfs-tree apply to the single-node targets only: the "
                    "transport and cluster workloads run the checkout's kspeedfs and rdma")

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, on_term)

    ctx = W.Context(work, scale, None if args.no_c else build_ramfs_c(work),
                    Path(args.ab_tree).resolve() if args.ab_tree else None,
                    cluster_chunk=args.cluster_chunk_size, only=frozenset(args.target))
    results = Results(_meta(args, scale, names))
    t0 = time.monotonic()
    try:
        for name in names:
            try:
                run_workload(W.WORKLOADS[name], ctx, results)
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                log.error("workload %s failed: %s", name, e)
                results.errors.append({"workload": name, "error": str(e)})
    except KeyboardInterrupt:
        print("\ninterrupted: mounts removed; writing what was measured", file=sys.stderr)
    finally:
        results.meta["seconds"] = round(time.monotonic() - t0, 1)
        files = results.write(out)
        print("\n" + results.table())
        if results.errors:
            print(f"\n{len(results.errors)} run(s) failed; see results.json 'errors'")
        print(f"\nwrote {', '.join(str(f) for f in files)}")
    return 1 if results.errors else 0
