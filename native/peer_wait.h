/* peer_wait.h — the library's native fetch: a small file's extent READ from a peer's
 * arena by the calling thread itself, with no trio thread and no GIL
 * (docs/design.md, "The library's native fetch").
 *
 *   trio thread (kspeedfs/cluster/peer_wait.py)       C
 *   a chunk's route (Peers.native_route)         ─► pw_peer: the peer's UP paths;
 *                                                    pw_route: the chunk's arena offset
 *   a reading thread, a small file's extent      ─► pw_read: a staging slot, one READ
 *                                                    (fetch_read.h) on the path's QP into
 *                                                    it, its WC on this fetch's own CQ
 *   the reaper thread ("ks-peerwait"): the WC    ─► the waiting caller woken (its cond)
 *   the caller (no GIL): xxh3-128 == the extent's ─► copied into the caller's buffer: 0
 *   digest?                             else     ─► a status (no route, no slot, late, a
 *                                                    WC error, short, mismatch): the
 *                                                    caller takes the Python read path
 *   the trio thread, every tick                  ─► pw_tally: per peer and path, READs
 *                                                    that came back, failed or were late,
 *                                                    for the vQP monitors and the counters;
 *                                                    pw_samples: each ok READ's time, for
 *                                                    the hedger
 *
 * Never right about a fault, only steps aside: a failed or late READ clears its chunk's
 * route (the next read of it goes to Python's path, which fails over and hedges). A
 * caller that gave up (late) leaves its record to the reaper, which frees its staging
 * slot when the WC comes (a WR with its own CQ always completes). Locks: w->lock guards
 * everything but the CQs, which only the reaper polls. No GIL anywhere here.
 */
#ifndef KSPEEDFS_PEER_WAIT_H
#define KSPEEDFS_PEER_WAIT_H

#include <stdint.h>

#include "fetch_read.h"
#include "fuse_fetch.h" /* struct fe_path, FE_PEERS, FE_PATHS, FE_NICS, FE_FETCH_ENGINES */

#define PW_MAX 64     /* READs out at once */
#define PW_STAGING 64 /* staging slots */
/* ok READs' samples held for the hedger between two pw_samples: every READ's time (a
 * sum would hide the tail its thresholds are made of), the first PW_SAMPLES a tick */
#define PW_SAMPLES 512

/* pw_read's statuses beyond fetch_read.h's */
enum {
    PW_NO_ROUTE = 80, /* the chunk has no route, or its peer no UP path */
    PW_BUSY = 81,     /* no staging slot of that size free, or PW_MAX out */
    PW_POST = 82,     /* the post failed (the route is cleared) */
    PW_BAD = 83       /* arguments out of range */
};

/* What came back from one peer's path since the last pw_tally. */
struct pw_tally {
    int peer, path;
    uint32_t qpn;
    uint64_t ok, bytes, failed, late; /* each ok READ's time: pw_samples */
};

struct pw;

struct pw *pw_new(uint64_t chunks, const struct ks_capi *api, char *err, size_t errlen);
/* This fetch's CQ on soft engine ``ke`` (held by the caller until pw_free), once. */
int pw_engine(struct pw *w, ks_engine *ke, const char **why);
/* A staging slot of ``size`` bytes, ``lkeys[nic]`` its lkey on each local NIC; -ENOSPC. */
int pw_staging(struct pw *w, void *laddr, uint32_t size, const uint32_t *lkeys, int nlkeys);
/* Peer ``peer``'s UP paths (≤ FE_PATHS; 0: off), used in turn; -EINVAL out of range. */
int pw_peer(struct pw *w, int peer, const struct fe_path *paths, int npaths);
/* Chunk ``k`` lies at byte ``offset`` of peer ``peer``'s arena (peer < 0: no route). */
int pw_route(struct pw *w, uint64_t k, int peer, uint64_t offset);
void pw_unroute(struct pw *w);
/* READ ``len`` bytes at ``offset`` of chunk ``k`` from its route, wait up to
 * ``timeout_ns`` for them, verify them against xxh3-128 ``want`` and copy them to
 * ``dest``: FE_FETCH_OK, else a status (fetch_read.h, PW_*) and ``dest`` is garbage. */
int pw_read(struct pw *w, uint64_t k, uint64_t offset, uint32_t len, const uint8_t *want,
            void *dest, uint64_t timeout_ns);
/* Up to ``max`` tallies since the last call (then zeroed); returns how many. */
int pw_tallies(struct pw *w, struct pw_tally *out, int max);
/* Up to ``max`` samples (peer, path, length, wall ns) of ok READs since the last call
 * (at most PW_SAMPLES were kept); returns how many, the rest dropped. */
int pw_samples(struct pw *w, struct fe_sample *out, int max);
/* Stop: no more reads; wait up to ``timeout_ms`` for the READs out, end the reaper,
 * close the CQs. Returns how many were still out. */
int pw_stop(struct pw *w, int timeout_ms);
void pw_free(struct pw *w);

#endif
