"""A real ``torch.utils.data.DataLoader`` epoch over raw file bytes (no decoding).

Run as ``python -m bench.dataloader ROOT LISTING [--workers 4] [--batch 32]``; prints one
JSON line of figures. A map-style dataset whose ``__getitem__`` reads one file whole,
a shuffling sampler (seeded), ``num_workers`` worker processes, and a collate that
keeps the samples as a list of bytes: the I/O a training input pipeline does, without
the decode cost that would hide it. ``--collate packed`` hands each batch over as one
uint8 tensor made in shared memory plus offsets (``kspeedfs.torch.packed``), as ``default_collate``
hands decoded batches over, instead of pickling every sample's bytes through the
worker's pipe (docs/benchmarks.md, "The library in a DataLoader and from peers").

``--library NAME --config JSON`` reads through the Python library instead of ROOT:
``kspeedfs.torch.MapDataset`` (each worker opens its own handle, batches come through
``read_many``). Each worker holds its own memory tier, so the suite runs it with
``--warm-epochs 1``: an unmeasured epoch first, workers persistent, fills them, as a
warm mount's tier is filled at its setup. Not for a mount: that epoch would fill the
kernel's page cache, which the suite drops before a mount's run so the mount answers
from its tier.

torch is installed into the venv by the suite only when this workload runs
(``pip install torch==2.13.0``, the CPU build); the test lanes never need it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from bench.system import machine_cpu, process_cpu


def main(argv: list[str] | None = None) -> int:
    import torch
    from torch.utils.data import DataLoader, Dataset

    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("listing", help="file with one relative path per line")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--library", metavar="NAME", help="read dataset NAME through kspeedfs.torch")
    p.add_argument("--config", default="{}", help="the library's config, a JSON mapping")
    p.add_argument("--warm-epochs", type=int, default=0)
    p.add_argument("--collate", choices=("list", "packed"), default="list")
    p.add_argument("--floor", action="store_true",
                   help="no reads: samples of ROOT's files' sizes from memory (the loader's own cost)")
    a = p.parse_args(argv)
    paths = [line for line in open(a.listing).read().splitlines() if line]

    class RawFiles(Dataset):
        def __len__(self) -> int:
            return len(paths)

        def __getitem__(self, i: int) -> bytes:
            with open(os.path.join(a.root, paths[i]), "rb", buffering=0) as f:
                return f.read()

    class Floor(Dataset):
        """Samples of the files' sizes from memory: the DataLoader's own cost a sample."""

        sizes = [os.path.getsize(os.path.join(a.root, p)) for p in paths] if a.floor else []
        blob = bytes(max(sizes, default=0))

        def __len__(self) -> int:
            return len(paths)

        def __getitem__(self, i: int) -> bytes:
            return self.blob[:self.sizes[i]]

    if a.floor:
        dataset: Dataset = Floor()
    elif a.library:
        from kspeedfs.torch import MapDataset
        dataset = MapDataset(a.library, paths, config=json.loads(a.config))
    else:
        dataset = RawFiles()
    if a.collate == "packed":
        from kspeedfs.torch import packed as collate
    else:
        collate = list                                      # type: ignore[assignment]
    g = torch.Generator()
    g.manual_seed(a.seed)
    loader = DataLoader(dataset, batch_size=a.batch, shuffle=True, generator=g,
                        num_workers=a.workers, collate_fn=collate, persistent_workers=True,
                        prefetch_factor=4)
    for _ in range(a.warm_epochs):
        for _batch in loader:
            pass
    # Worker start-up (fork, torch import in each) is not I/O: the clock starts once
    # the first batch is out, and that batch is not counted.
    it = iter(loader)
    next(it)
    t0, tree0, host0 = time.perf_counter(), _tree_cpu(), machine_cpu()
    files = nbytes = 0
    for batch in it:
        if a.collate == "packed":
            files += len(batch[1]) - 1
            nbytes += int(batch[1][-1])
        else:
            files += len(batch)
            nbytes += sum(len(b) for b in batch)
    dt = time.perf_counter() - t0
    tree, host = _tree_cpu() - tree0, machine_cpu() - host0
    print(json.dumps({"files/s": files / dt, "MB/s": nbytes / dt / 1e6, "seconds": dt,
                      "files": files, "bytes": nbytes,
                      "loader_cpu_us_per_file": 1e6 * tree / files,
                      "host_cpu_us_per_file": 1e6 * host / files}))
    return 0


def _tree_cpu() -> float:
    """CPU seconds of this process and its live children (the persistent workers); a
    mount's daemon is not in it (``host_cpu_us_per_file`` counts the whole machine)."""
    pids = [os.getpid()]
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                pids += [int(p) for p in f.read().split()]
        except OSError:
            pass
    return sum(process_cpu(pid) or 0.0 for pid in pids)


if __name__ == "__main__":
    sys.exit(main())
