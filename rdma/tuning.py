"""The transport's knobs, in one place: each value with the reason for it.

kspeedfs's own are in ``kspeedfs/tuning.py`` (an upper layer: this one must not import
it), the C engines' in ``native/tuning.h``. Wire formats and protocol limits that a peer
relies on (frame sizes, opcodes, nonce and MAC sizes) are not knobs and stay in the
modules that define them.
"""
from __future__ import annotations

# -- paths (vrdma/path.py, vrdma/nic.py) --------------------------------------------

#: send-queue depth of every path QP; one slot is kept for the heartbeat probe
SQ_DEPTH = 256
#: more send-queue entries, beyond SQ_DEPTH, for READs posted in C beside the vQP's (the
#: FUSE engine's native fetch, FE_FETCH_MAX in native/fuse_fetch.h): they never take a
#: slot the dispatcher counts on
NATIVE_SQ_DEPTH = 256
#: outstanding READs one path QP keeps in flight (``max_rd_atomic``), capped by the device
MAX_RD_ATOMIC = 16

# -- the pre-authentication gate (vrdma/handshake.py) --------------------------------

#: unauthenticated connections from one address, per listener
PREAUTH_PER_SOURCE = 32
#: unauthenticated connections in all, per listener
PREAUTH_TOTAL = 128
#: seconds between two refusal log lines of one listener
REFUSAL_LOG_EVERY = 10.0

# -- the soft provider (providers/soft/) ----------------------------------------------

#: how long a soft QP's connection to its peer may take to open (s)
CONNECT_TIMEOUT_S = 5.0

# -- the verbs provider's CQ poll thread (providers/verbs/cq.py) ----------------------

#: its first sleep between two polls that found nothing, doubling up to the most: a
#: waiting caller pays at most one sleep of latency
CQ_MIN_SLEEP = 50e-6
CQ_MAX_SLEEP = 1e-3
#: seconds with nothing outstanding and nothing completed before it parks
CQ_LINGER = 2.0
#: WCs taken by one ibv_poll_cq
CQ_BATCH = 32
