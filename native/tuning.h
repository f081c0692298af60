/* tuning.h — the C engines' knobs, in one place: each value with the reason for it.
 *
 * The Python side's are in kspeedfs/tuning.py and rdma/tuning.py. Wire formats, ABI
 * sizes and table capacities that a peer or the kernel relies on are not knobs and stay
 * in the headers that define them (soft_engine.h, fuse_engine.h, fuse_uring_abi.h). */
#ifndef KSPEEDFS_TUNING_H
#define KSPEEDFS_TUNING_H

/* -- the soft RDMA engine (soft_*.c) ------------------------------------------------ */

/* bytes one handler call moves before it releases the engine lock */
#define KS_TX_BUDGET (8u << 20)
#define KS_RX_BUDGET (8u << 20)
/* While a READ response has at least this much payload to come, the requester socket's
 * SO_RCVLOWAT is raised to it: one wake-up per KS_LOWAT bytes instead of one per skb.
 * (The transport timer counts bytes we have read, so a path slower than
 * KS_LOWAT per timeout could time out early; 256 KiB per ~0.5 s is far below any NIC.) */
#ifndef KS_LOWAT
#define KS_LOWAT (256u << 10)
#endif
#define KS_LOWAT_MIN (16u << 10) /* below this the setsockopt costs more than it saves */
/* A post whose READs ask for at least this many bytes rings the doorbell even on an idle
 * QP (design notes, "Requester"): their transfer takes 20-100x the engine thread's wake. */
#define KS_DOORBELL_READ (1u << 20)
/* accepts per listener event, so the HELLOs of the connections already accepted are read
 * in between */
#define KS_ACCEPT_BATCH 16
#define KS_LISTEN_PAUSE_MS 100   /* out of fds (EMFILE...): stop accepting this long */
#define KS_HELLO_TIMEOUT_MS 2000 /* HELLO must arrive within this after accept */
#define KS_MAX_HELLO_CONNS 256   /* accepted, no valid HELLO yet (all sources) */
#define KS_MAX_HELLO_PER_SRC 64  /* the same, per source IPv4 address */
#define KS_RESP_JOBS 1024        /* queued READ responses / SEND acks per connection */
#define KS_STAGE 16384           /* rx staging buffer (headers, small payloads) */
#define KS_SMALL 4096            /* responses up to this are read via the stage */

/* -- the FUSE engine (fuse_*.c) ----------------------------------------------------- */

/* The solo gate and the crowd rule (fuse_threads.c says how they decide; the figures:
 * docs/design.md, "The solo gate and the crowd rule"): the window both judge over ... */
#define FE_SOLO_NS 20000000ull
/* ... a READ this large is readahead, answered ahead of need ... */
#define FE_SOLO_READ (256u << 10)
/* ... a crowd's requests are short under this on average ... */
#define FE_CROWD_SHORT_NS 50000ull
/* ... and one thread could answer them all below this share of the window busy */
#define FE_CROWD_BUSY_PCT 90u
/* READ replies from this size on go by vmsplice + splice (fuse_reply.c); each thread's
 * pipe asks for this much room (a 1 MiB reply spans 257 pages) */
#define FE_SPLICE_MIN (256 << 10)
#define FE_PIPE_WANT (2 << 20)
/* entries per io_uring queue: 32 per CPU is, on 2 CPUs, the default max_background (64)
 * of requests in flight (fuse_uring.c) */
#define FE_URING_DEPTH 32
/* the late fetches' check period while one with a deadline is out: a deadline is the
 * peer's hedging threshold (>= 2 ms, ~20-100 ms for a chunk), so 5 ms is within its noise */
#define FE_LATE_TICK_MS 5
/* a part's own buffer starts on a page from this size on (kspeedfs/tuning.py ALIGN_MIN,
 * the same value: the memory tier's rule for Python's buffers) */
#define FE_ALIGN_MIN (64u << 10)
/* the C tier's index: lock stripes, and 2^bits hash buckets */
#define FE_STRIPES 256
#define FE_BUCKET_BITS 18

#endif
