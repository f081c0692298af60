"""③ The local chunk cache: ``memory.py`` (bounded LRU of verified chunks), ``disk.py``
(optional SSD tier, verified on load), ``singleflight.py`` (one load per chunk, however
many readers wait), ``prefetch.py`` (sequential readers get the next chunks early),
``tiers.py`` (the chain memory → disk → peers → source that the mount's reader and a
cluster node share), ``handoff.py`` (which of the chain's loads and READs go to the
native fetch, in C).

Chunks are keyed by their xxh3-128 digest, not by (dataset, index): identical chunks of
two versions or two datasets share one cache slot, and a key can never name stale bytes.
"""
