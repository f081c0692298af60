"""kspeedfs benchmark suite: kspeedfs and its baselines, measured interleaved, reported as ratios.

Entry point ``python -m bench`` (``bench/run.py``); see docs/benchmarks.md.
"""
