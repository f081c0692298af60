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

#endif
