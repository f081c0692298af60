"""A real ``torch.utils.data.DataLoader`` epoch over raw file bytes (no decoding).

Run as ``python -m bench.dataloader ROOT LISTING [--workers 4] [--batch 32]``; prints one
JSON line of figures. A map-style dataset whose ``__getitem__`` reads one file whole,
a shuffling sampler (seeded), ``num_workers`` worker processes, and a collate that
keeps the samples as a list of bytes: the I/O a training input pipeline does, without
the decode cost that would hide it.

torch is installed into the venv by the suite only when this workload runs
(``pip install torch==2.13.0``, the CPU build); the test lanes never need it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    import torch
    from torch.utils.data import DataLoader, Dataset

    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("listing", help="file with one relative path per line")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seed", type=int, default=7)
    a = p.parse_args(argv)
    paths = [line for line in open(a.listing).read().splitlines() if line]

    class RawFiles(Dataset):
        def __len__(self) -> int:
            return len(paths)

        def __getitem__(self, i: int) -> bytes:
            with open(os.path.join(a.root, paths[i]), "rb", buffering=0) as f:
                return f.read()

    g = torch.Generator()
    g.manual_seed(a.seed)
    loader = DataLoader(RawFiles(), batch_size=a.batch, shuffle=True, generator=g,
                        num_workers=a.workers, collate_fn=list, persistent_workers=False,
                        prefetch_factor=4)
    # Worker start-up (fork, torch import in each) is not I/O: the clock starts once
    # the first batch is out, and that batch is not counted.
    it = iter(loader)
    next(it)
    t0 = time.perf_counter()
    files = nbytes = 0
    for batch in it:
        files += len(batch)
        nbytes += sum(len(b) for b in batch)
    dt = time.perf_counter() - t0
    print(json.dumps({"files/s": files / dt, "MB/s": nbytes / dt / 1e6, "seconds": dt,
                      "files": files, "bytes": nbytes}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
