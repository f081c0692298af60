"""``./run demo`` = ``python -m kspeedfs.demo``: the cluster demo, or ``--single-node``, or
``--s3`` (single node, the source a bucket on a local S3 server)."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kspeedfs-demo", description=__doc__)
    ap.add_argument("--single-node", action="store_true",
                    help="no cluster: import, mount and read on this machine only")
    ap.add_argument("--s3", action="store_true",
                    help="single node, the source a bucket on a local S3 server (moto)")
    ap.add_argument("--files", type=int, default=3000, help="ImageNet-like files to generate")
    ap.add_argument("--workdir", help="where to put the sample data (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="leave the work directory behind")
    args = ap.parse_args(argv)
    if args.single_node or args.s3:
        from .single import main as run
    else:
        from .cluster import main as run
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
