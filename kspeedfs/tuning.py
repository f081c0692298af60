"""The knobs of kspeedfs's own code that trade speed, memory or patience, in one place.

A user-facing choice lives in the config tree (``config.py``, ``kspeedfs config``); what
is here is fixed per build: each value with the reason for it, the measurements behind
it in docs/design.md under the heading named. The transport's knobs are in
``rdma/tuning.py`` (a lower layer that must not import this one); the C engines' in
``native/tuning.h``. Formats and protocols (digest sizes, wire opcodes, manifest
formats, arena geometry) are not knobs and stay with the code that defines them.

Grouped by the step of a read they tune (docs/design.md, "The steps of a read").
"""
from __future__ import annotations

# -- the FUSE boundary (fuse/) --------------------------------------------------------

#: st_blksize when ``fuse.blksize`` is 0 (config.py says why: sweep-blksize)
SMALL_BLKSIZE = 4096

# -- local tiers (cache/memory.py) ---------------------------------------------------

#: buffers from this size on start on a page boundary: the padding (2 KiB on average,
#: not counted in the tier's bytes) is then at most ~3 % of a buffer; below it the saving
#: is a few short copies. native/fuse_fetch.c's FE_ALIGN_MIN is the same value.
ALIGN_MIN = 64 << 10
#: chunk buffers at least this large get their own mapping, faulted in without the GIL
#: (cache/memory.py ``_populated``); smaller ones stay bytearrays: a mapping each for
#: small extents would spend the process's map count (vm.max_map_count)
POPULATE_MIN = 1 << 20
#: such mappings kept for reuse once no view holds them (zeroed again, not faulted in
#: again): a process's chunk loads past a full memory tier reuse what it evicted
SPARE_BYTES = 64 << 20
#: default share of the memory tier kept as an LRU for what the resident part has no
#: room for ...
TRANSIENT_FRACTION = 0.25
#: ... and its least size (the whole tier, when that is smaller)
TRANSIENT_MIN = 128 << 20

# -- read policy (read_policy.py): what a miss loads ---------------------------------

#: files up to chunk_size / this are fetched alone (one extent READ from a replica, or
#: read from the source) when the dataset outgrows the tiers
SMALL_FILE_DIVISOR = 8
#: blocks of one chunk loaded for random reads before the next miss loads it whole
#: (when the dataset fits the tiers; ReadPolicy.blocks_for)
PROMOTE_AFTER = 1
#: blocks a random read may load instead of its chunk: Python's buffered open() asks for
#: st_blksize at any offset, which the kernel rounds to pages and sometimes merges with
#: its readahead (three or four blocks); a shard reader's 1 MiB requests load the chunk
MAX_READ_BLOCKS = 4
#: chunks whose block loads are counted at once (the oldest count is dropped)
PROMOTE_TRACKED = 1 << 16

# -- object-store sources (objstore/) -------------------------------------------------

#: keys one listing page holds (S3's and GCS's; Azure's 5,000): key ranges are sized in
#: pages (docs/design.md, "Object-store sources", listing)
LIST_PAGE = 1000
#: a key range is planned to fill this share of its last page, so that the key ending it
#: comes on that page rather than on one more request
LIST_RANGE_FILL = 0.9
#: the listing splits once its first range has waited this share of its first page's
#: time for the next: pages that come faster were one response (fake-gcs-server answers
#: a listing whole), where more requests only repeat the server's work
LIST_SPLIT_WAIT = 0.25
#: ... and at least this long (s): a page of a response already in hand takes ~2 ms to
#: convert, a page from a server a round trip
LIST_SPLIT_WAIT_MIN = 0.02
#: levels of common prefixes the split looks down for its points, one request each
LIST_SPLIT_DEPTH = 3

# -- the library (client/) ------------------------------------------------------------

#: concurrent file reads of one ``read_many`` (each file's chunks load concurrently too)
READ_MANY_CONCURRENCY = 64

# -- placement and peers (cluster/) ---------------------------------------------------

#: slot hints kept (~180 B each, 3 MB: 64 GiB of 4 MiB chunks)
HINTS = 1 << 14
#: a node's whole arena index is READ at once for the native fetch's routes when it fits
#: one staging slot, at most once per this many seconds per node incarnation (again
#: after a stale hint from it, or once the copy is INDEX_TRUST seconds old)
INDEX_REFRESH = 1.0
#: an index copy says a chunk is not on its node for this long, and is READ again after
#: it when it is looked at: a node may take chunks later (re-replication)
INDEX_TRUST = 10.0
#: a key goes to its second arena bucket only once its first holds this many entries
#: (and the second fewer): few keys away from their first, no full buckets at a full
#: arena (cluster/arena.py's docstring)
SPILL = 6
#: landing slots registered at a time (16 x 4 MiB = one 64 MiB vMR)
SEGMENT = 16
#: idle RPC channels a client keeps per node (it opens more under load) ...
RPC_POOL = 4
#: ... and handshakes it runs at once to one node, well under a server's 32
#: unauthenticated connections per source
RPC_OPENING = 8

#: seconds an unreachable node is skipped before it is tried again
UNREACHABLE_SKIP = 2.0
#: replica orders kept per membership (all dropped when there are more): a read's
#: rendezvous hash over every member costs more than a kept order (docs/design.md, "Peer
#: reads in Python: the figures behind the code")
PLACED_ORDERS = 1 << 14
#: physical staging slots at most, x the fetch's buffers (reads in progress + losers)
STAGING_PER_BUF = 3

# -- the native fetch (cluster/native/) -----------------------------------------------

#: chunk READs the native fetch has out at once, beside the ``nbuf`` of read_chunk: each
#: holds a landing slot (registered only when used). Its own, not shared with
#: read_chunk: shared, the Python path kept most of the chunks (docs/design.md, "The
#: native chunk fetch")
NATIVE_READS = 32
#: seconds a chunk or a small file's extent whose native fetch failed is not handed to C
#: with a READ again (that READ takes Python's path)
NATIVE_FAILED_FOR = 1.0
#: chunks after one Python started whose routes it gives C (``Routes.ahead``): the next
#: hint for that stream comes this many chunks later
ROUTE_AHEAD = 8
#: landing slots C holds for the chunks it starts (``Routes.feed``)
C_SLOTS = 16
#: staging slots C holds for good for the small files' extents it starts (each of
#: ReadPolicy.small_file_limit bytes): twice the readers of the ImageNet-like case
C_STAGING = 16

# -- hedging (cluster/hedge.py) -------------------------------------------------------

#: latency samples kept per (peer, size class)
HEDGE_WINDOW = 256
#: fewer samples than this: the class over all peers, then the cap
HEDGE_MIN_SAMPLES = 32
#: the threshold is recomputed every this many samples
HEDGE_RECOMPUTE = 16
#: overruns of a peer without an in-time READ in between before it is suspect
SUSPECT_AFTER = 2

# -- node lifecycle (cluster/reconcile.py, cluster/arena_files.py) -------------------

#: a crashed holder's preload is released after this many lease TTLs
RELEASE_GRACE_TTLS = 2

#: how long a starting node waits for its predecessor's arena lock: a node killed and
#: started again at once finds the dying process still holding it
ARENA_LOCK_WAIT = 10.0

# -- manifest pages from peers (cluster/page_copy.py, manifest/load.py) ---------------

#: zlib'd bytes of one page in a ``page`` RPC reply at most: base64'd in JSON it stays
#: under the control channel's 1 MiB frame; a page that does not fit (only 1 MiB pages
#: that barely compress) comes from store.pages instead
PAGE_REPLY_MAX = 512 << 10
#: peers asked for a page, in rendezvous order, before a node with store.pages reads it
#: there (a node without store.pages asks every member)
PAGE_PEER_TRIES = 3
#: seconds a node keeps the pages of a version no longer preloaded (a mount started on
#: it may still fault them in from the copy)
PAGE_COPY_GRACE = 3600.0
#: seconds a mount with no store.pages waits for its host's node to copy a version's
#: pages (the node writes the table pages last, so their presence means all are there)
PAGE_COPY_WAIT = 60.0
#: seconds after which a page an import reuses in a bucket ``store.pages`` is written
#: again: an object cannot be touched as a file is, and the rewrite restarts the sweep's
#: grace (an hour) for a version not yet published (docs/design.md "Paged manifests")
PAGE_REWRITE_AGE = 1800.0
#: a bucket ``store.pages``: pages an import writes at once (PUTs overlap their round
#: trips; docs/benchmarks.md "Manifest pages in a bucket")
PAGE_PUTS = 8
#: seconds a mount's page ask has to arrive whole at the node (40 bytes: a slow or
#: silent client is closed) ...
ASK_READ = 2.0
#: ... and the node's time to get the page (peers, then store.pages); the page map waits
#: ``ASK_MS`` for the answer
ASK_DEADLINE = 8.0
#: milliseconds the page map waits for the node at each step of an ask (connect, send,
#: answer): more than ASK_DEADLINE, so the node's "no" arrives rather than a timeout
ASK_MS = 10_000

# -- mount supervision (fuse/supervisor.py, compose.py) -------------------------------

#: daemon restarts allowed in RESTART_WINDOW seconds before the supervisor gives up
MAX_RESTARTS = 5
RESTART_WINDOW = 60.0
#: the pause between daemons started to resume one death (s, doubling up to the most);
#: ``fuse.resume_patience`` bounds them all
RESUME_BACKOFF = 0.5
RESUME_BACKOFF_MOST = 8.0
#: how long a new daemon may take to call back (s)
CALL_TIMEOUT = 60.0
#: how long a new daemon that called and then did not take the connection may take to exit
REAP_WAIT = 5.0
#: seconds a resumed daemon waits for the cluster's node list
RESUME_FIRST_WAIT = 1.0

# -- the store (manifest/store/etcd_client.py, etcd_versions.py) ----------------------

#: compare-and-swap attempts per etcd transaction; each one lost means another writer won
CAS_ATTEMPTS = 200

#: a failing etcd channel is dialled again at most this often (s)
ETCD_MIN_CHANNEL_AGE = 3.0

#: an ending keep-alive stream waits this long (s) for gRPC to leave its request
#: iterator before it releases the channel (``etcd_keepalive.py``)
ETCD_KEEPALIVE_ITERATOR_EXIT = 1.0

# -- import (manifest/importer.py, manifest/spill.py) ----------------------------------

#: entries the importer's arrays hold in memory before they are written to their spill
#: files (~4 MB of tails at ~60 B per entry); the rest lives in the page cache
#: (docs/design.md, "The importer's peak memory")
IMPORT_SPILL_ENTRIES = 1 << 16
#: bytes a spilled array reads at once for single items and short ranges ...
SPILL_BLOCK = 64 << 10
#: ... and such blocks it keeps (~1 MB per array): the hashing threads' reads of sizes
#: and names, in entry order, then cost one pread per block, not per file
SPILL_CACHED = 16
#: the largest piece of the manifest's inflated bytes handed to the store at once
IMPORT_PIECE = 8 << 20
#: directory paths kept for the source's reads (FileSource and object keys, which
#: derive a file's path from its parent's)
IMPORT_PATHS = 1 << 12

#: staging slots of the library's native fetch (cluster/peer_wait.py): one a reading
#: thread with its READ out, a DataLoader's 8-16 threads and some to spare (peer_wait.h
#: PW_STAGING is the most C takes)
LIB_STAGING = 32
#: how long a reading thread waits for its READ through C without hedging on
#: (``cluster.hedge`` off): then the Python read path takes the file, and the READ's
#: staging slot comes back when its WC does
LIB_WAIT = 0.5
#: seconds between the library's native fetch's tallies fed to the vQP monitors, the
#: hedger and the peer counters (the monitor's SUSPECT needs ~1 s of silence)
LIB_TICK = 0.05
