/* fuse_fetch.h — the native chunk fetch: a chunk READ from a peer's arena posted by
 * Python, completed, verified and answered in C (docs/design.md, "The plan for that step").
 *
 *   Python (kspeedfs/cluster/native/fetch.py)          C
 *   a chunk to load, its replica's slot known, an  ─► fetch_post: a record for chunk k,
 *   UP path on the soft provider                       one RDMA READ into a landing slot,
 *                                                      its WC on the fetch's own CQ
 *   READs of k meanwhile (request threads)         ─► fetch_park: held on k's record
 *                                                      (a READ of several chunks: when each
 *                                                      one missing is in flight, on the first)
 *   the fetch thread: WC ─► xxh3-128 == k's digest? ─► tier_put_new (no owner yet),
 *                                                      the parked READs answered from it
 *                                                 ─► event FE_FETCHED (status 0) to Python,
 *                                                      which adopts the slot (tier_put)
 *                          anything else          ─► FE_FETCHED (status != 0) first, then
 *                                                      the parked READs queued for Python
 *
 *   a small file's READ (queued to Python), its  ─► fetch_post_part: the same, with the
 *   chunk's slot known: the extent and the READ       READ parked on the record; READ into
 *   (or a random READ's block, the same)
 *                                                      a staging slot, xxh3-128 == the
 *                                                      extent's digest? ─► copied into a
 *                                                      buffer of its own (malloc), put, the
 *                                                      READ answered; Python takes the
 *                                                      buffer (fetch_landed) and adopts it
 *
 *   a chunk entering a sequential reader's       ─► fetch_start (request thread, at the
 *   prefetch window (fuse_read.c do_read)            prefetch hint): when Python routed it
 *                                                    (fetch_route: its replica and slot
 *                                                    there, fetch_peer: that peer's UP
 *                                                    paths) and gave a landing slot
 *                                                    (fetch_slot), posted here with no hint
 *                                                    to Python: a C-started fetch (cookie
 *                                                    with FE_OWN); its FE_FETCHED names
 *                                                    the slot, the peer and the path
 *   past the peer's hedging limit, not back       ─► FE_FETCHED with FE_FETCH_LATE (once;
 *                                                    the fetch goes on): Python hedges it
 *
 *   a small file's READ that missed, its chunk    ─► fetch_start_part (request thread,
 *   routed and a staging slot free                   fuse_read.c do_read): its one
 *                                                    extent READ into one of C's staging
 *                                                    slots (fetch_staging), the READ parked
 *                                                    on it, verified, copied out and put as
 *                                                    fetch_post_part's; the staging slot is
 *                                                    C's again at once; FE_FETCHED (cookie
 *                                                    with FE_OWN | FE_PART) names the file,
 *                                                    its chunk, the peer and the path when
 *                                                    it was LATE (or the tally is full);
 *                                                    else a sample (the buffer and its key
 *                                                    in it) for FE_FETCH_TALLY (so are the
 *                                                    blocks fetch_start_block starts);
 *                                                    with fetch_keep 0 (no resident room
 *                                                    in Python's tier), an extent's READs
 *                                                    answered from the staging slot,
 *                                                    nothing kept, a sample without a
 *                                                    buffer (a block is kept still)
 *
 * The READ and its check (WC, length, xxh3) are fetch_read.c's, shared with the
 * library's native fetch (peer_wait.h), whose completions wake a waiting caller instead.
 *
 * The fetch is never right about a fault, only steps aside: a WC error, a short READ or
 * a digest mismatch (the replica reused the slot) hands everything to Python's path.
 * Python decides what to fetch (placement, hints, path state, the prefetch budget);
 * C never picks a peer: a C-started fetch follows the route Python published for that
 * chunk, which a failure clears (the chunk's next hint goes to Python).
 *
 * Locks: f->lock guards the records (a handful in flight: a linear scan); the fetch
 * thread is the only caller of the soft engine's cq_poll on the fetch's CQs; post and
 * park run on any thread. No GIL anywhere here.
 */
#ifndef KSPEEDFS_FUSE_FETCH_H
#define KSPEEDFS_FUSE_FETCH_H

#include <stdint.h>

#include "fetch_read.h" /* FE_FETCH_*: FE_FETCHED's status beyond the WC's */
#include "soft_engine.h"

#define FE_FETCH_MAX 256       /* fetches in flight at once */
#define FE_FETCH_ENGINES 8     /* soft engines (local NICs) with a fetch CQ */
#define FE_NO_CHUNK UINT64_MAX /* FE_FETCHED's chunk for an extent's fetch */

#define FE_OWN (1ULL << 63)   /* in the cookie of a fetch C started (fetch_start) */
#define FE_PART (1ULL << 62)  /* beside FE_OWN: a small file's extent (fetch_start_part) */
#define FE_BLOCK (1ULL << 61) /* beside FE_PART: a random read's block (fetch_start_block) */
#define FE_PEERS 64           /* peers routes may name */
#define FE_PATHS 2            /* UP paths a peer's entry holds (used in turn) */
#define FE_NICS 4             /* local NICs a landing slot has an lkey on */
#define FE_SLOTS 64           /* landing slots Python may give C at once */
#define FE_STAGING 32         /* staging slots for the extents C starts (fetch_staging) */
/* FE_FETCHED's status (beside fetch_read.h's) of a tally: samples for fetch_tally, no
 * fetch of its own */
#define FE_FETCH_TALLY 70
#define FE_TALLY_MAX 1024      /* samples held for Python; full: extents are kept again */
#define FE_TALLY_EVERY 64      /* a tally once this many wait, */
#define FE_TALLY_NS 5000000ULL /* or once the oldest is this old (the LATE tick) */
/* the hedger's READ size classes (cluster/hedge.py): ≤4K, ≤16K, ≤64K, ≤256K, ≤1M, ≤4M,
 * larger */
#define FE_SIZE_CLASSES 7

/* One UP path to a peer: the soft engine of its local NIC (a fetch CQ there), its QP, the
 * peer's arena through it, and which of a landing slot's lkeys it takes. */
struct fe_path {
    ks_engine *ke;
    uint32_t qpn, rkey, nic;
    uint64_t raddr; /* the arena's first byte through this path */
};

struct fe_engine;
struct fe_read;
struct fe_tier;
struct fe_fetch;

/* One part C started and Python holds no record of, told in the tally instead of by an
 * FE_FETCHED, for Python's hedger and counters: peer and path numbers as an FE_FETCHED's,
 * its length and its READ's time from post to verified bytes. Not kept (fetch_keep 0,
 * an extent answered from its staging slot): ``buf`` NULL. Kept: ``buf`` (malloc'd), in
 * the tier under ``key[0..keylen)`` with no owner, which the taker adopts (or frees). */
struct fe_sample {
    int32_t peer, path;
    uint32_t len;
    uint64_t took_ns;
    void *buf;
    uint8_t key[20], keylen;
};
struct fe_fetch_counters {
    /* parked: per READ and chunk waited for */
    uint64_t posted, landed, failed, parked, answered;
    uint64_t redundant;     /* landed verified, but the tier had the chunk (EXISTS) */
    uint64_t started;       /* of ``posted``: started in C (fetch_start, _start_part) */
    uint64_t started_parts; /* of ``started``: small files' extents (fetch_start_part) */
    uint64_t unkept;        /* of ``landed``: extents answered from the slot, not kept */
    uint64_t tallied;       /* of ``landed``: parts told in a tally, not an FE_FETCHED */
};

struct fe_fetch *fetch_new(struct fe_engine *e, struct fe_tier *t,
                           const uint8_t *chunk_digests, const uint32_t *chunk_len,
                           uint64_t chunks, const struct ks_capi *api, char *err,
                           size_t errlen);
/* A fetch CQ on soft engine ``ke`` (held by the caller until fetch_free), once. */
int fetch_engine(struct fe_fetch *f, ks_engine *ke, const char **why);
/* READ ``len`` bytes at ``raddr``/``rkey`` on QP ``qpn`` of ``ke`` into ``laddr``/``lkey``,
 * as chunk ``k``; ``cookie`` comes back in FE_FETCHED. -EALREADY: k is in flight;
 * -EAGAIN: FE_FETCH_MAX in flight; -ESHUTDOWN: stopped; else the post's error. */
int fetch_post(struct fe_fetch *f, ks_engine *ke, uint32_t qpn, uint64_t k, uint64_t cookie,
               void *laddr, uint32_t lkey, uint64_t raddr, uint32_t rkey, uint32_t len,
               const char **why);
/* A part of a chunk, a small file's extent or a block of a random read: READ ``len`` bytes
 * into the staging buffer ``laddr``/``lkey``, verify them against ``want`` (xxh3-128, 16
 * bytes; xxh3-64, 8: a block), copy them into a buffer of their own and put that in the
 * tier under ``key`` (16 bytes: an extent's digest; 20: a block's, manifest/model.py block_key) with
 * no owner: with status 0, the caller takes the buffer with fetch_landed and puts it,
 * adopting the entry. ``read`` (or NULL): the READ the caller took from the queue,
 * parked on the record (answered as a chunk's parked READs are); when the post fails it
 * stays the caller's. Other READs of that file that miss park on it too
 * (fetch_start_part). Errors as fetch_post's. */
int fetch_post_part(struct fe_fetch *f, ks_engine *ke, uint32_t qpn, const uint8_t *key,
                    size_t keylen, const uint8_t *want, size_t wantlen,
                    const struct fe_read *read, uint64_t cookie, void *laddr, uint32_t lkey,
                    uint64_t raddr, uint32_t rkey, uint32_t len, const char **why);
/* The buffer (malloc'd; the caller frees it) an extent's fetch of ``cookie`` put in the
 * tier, and its length; NULL when there is none (or it was taken). Unclaimed ones are
 * freed by fetch_free. */
void *fetch_landed(struct fe_fetch *f, uint64_t cookie, uint32_t *len);
/* Hold READ ``rd`` (fd or ring token set) of chunks [first, last] when every one of them
 * the tier lacks is in flight: parked on the first such, 1 (answered again when it lands:
 * from the tier, parked on the next, or queued for Python); else 0. */
int fetch_park(struct fe_fetch *f, uint64_t first, uint64_t last, const struct fe_read *rd);
/* Answer the READs parked on the fetch of ``cookie`` now (its bytes came another way: a
 * hedge READ Python made); the fetch itself goes on, but no READ parks on it any more
 * (the chunk may be evicted again before that READ fails at the peer timeout: READs
 * parked on it then waited for that, 0.3-0.5 s). Returns how many. */
int fetch_unpark(struct fe_fetch *f, uint64_t cookie);
/* Peer ``peer``'s entry: ``npaths`` (≤ FE_PATHS; 0: off) UP paths, used in turn, and the
 * hedging limits of a chunk READ from it and of a small file's extent's, by its size
 * class (``part_limits``: FE_SIZE_CLASSES of them, or NULL; 0: none). -EINVAL for a peer
 * out of range. */
int fetch_peer(struct fe_fetch *f, int peer, const struct fe_path *paths, int npaths,
               uint64_t limit_ns, const uint64_t *part_limits);
/* Chunk ``k`` lies at byte ``offset`` of peer ``peer``'s arena (peer < 0: no route). */
int fetch_route(struct fe_fetch *f, uint64_t k, int peer, uint64_t offset);
/* Forget every route and peer (Python renumbers its peers). */
void fetch_unroute(struct fe_fetch *f);
/* A landing slot for C-started fetches: ``id`` comes back in their FE_FETCHED (struct
 * fe_fetched's ``slot``, beside the ``peer`` and ``path``), ``lkeys[nic]`` its lkey on each
 * local NIC. -ENOSPC when FE_SLOTS are held. */
int fetch_slot(struct fe_fetch *f, uint32_t id, void *laddr, const uint32_t *lkeys,
               int nlkeys);
/* A staging slot of ``size`` bytes for the extents C starts (fetch_start_part): C's from
 * now on, used again as soon as each READ into it completed (its bytes are copied out).
 * -ENOSPC when FE_STAGING are held. */
int fetch_staging(struct fe_fetch *f, void *laddr, uint32_t size, const uint32_t *lkeys,
                  int nlkeys);
/* Start small file ``read->entry``'s one extent (``len`` bytes at ``offset`` of chunk
 * ``k``, digest and tier key ``key``, 16 bytes) here, READ ``read`` parked on it, when
 * ``k`` has a route to a peer that is on and a staging slot of ``len`` bytes is free; or
 * park ``read`` on that extent's fetch in flight: 1. Else 0 (``read`` stays the
 * caller's). Any thread. */
int fetch_start_part(struct fe_fetch *f, uint64_t k, uint64_t offset, uint32_t len,
                     const uint8_t *key, const struct fe_read *read);
/* The same for block ``b`` of chunk ``k`` (``len`` bytes at ``offset``, tier key ``key``:
 * 20 bytes, manifest/model.py block_key; ``want``: its xxh3-64, 8 bytes), for a random READ inside
 * it; its FE_FETCHED's cookie has FE_BLOCK and its ``slot`` is ``b``. */
int fetch_start_block(struct fe_fetch *f, uint64_t k, uint64_t b, uint64_t offset,
                      uint32_t len, const uint8_t *key, const uint8_t *want,
                      const struct fe_read *read);
/* Whether the verified extents C starts are kept (1, the default: copied into a buffer
 * of their own and put in the tier, for Python to adopt), or (0) their parked READs
 * answered from the staging slot and nothing kept. Python sets it from its memory tier's
 * resident room (docs/design.md, "Small files from peers, not kept"). Either way, and for
 * the random reads' blocks C starts (always kept), Python is told a tally: a sample per
 * part (fetch_tally), an FE_FETCHED with FE_FETCH_TALLY once FE_TALLY_EVERY wait or the
 * oldest is FE_TALLY_NS old ("Kept extents told in batches"). A fetch reported LATE
 * (Python holds a record of it), or with no room for its sample, ends in an FE_FETCHED
 * as before, kept. */
void fetch_keep(struct fe_fetch *f, int keep);
/* Up to ``max`` samples into ``out`` (oldest first; a kept one's ``buf`` is the caller's
 * from now on); how many. Emptied, the next sample sends a tally again. */
int fetch_tally(struct fe_fetch *f, struct fe_sample *out, int max);
/* Start chunk ``k`` here if it has a route to a peer that is on and a landing slot is free:
 * 1 (or it is in flight already), else 0 (the caller hints Python). Any thread. */
int fetch_start(struct fe_fetch *f, uint64_t k);

/* Stop: no more posts; wait up to ``timeout_ms`` for every posted READ's WC, then end the
 * thread and close the CQs. Returns how many were still out (their records are
 * abandoned: their CQs are left for the soft engine's close). */
int fetch_stop(struct fe_fetch *f, int timeout_ms);
void fetch_free(struct fe_fetch *f);
void fetch_counters(struct fe_fetch *f, struct fe_fetch_counters *c);

#endif
