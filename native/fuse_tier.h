/* fuse_tier.h — the memory tier's verified buffers as the native engine sees them.
 *
 * A table of slots by key (a 16-byte chunk or extent digest, or 20: a chunk digest and a
 * 4-byte block number), 2^18 buckets under 256 striped locks. The buffers belong to the
 * caller (Python's MemoryCache, through the binding): a slot holds a pointer and the
 * caller's ``owner`` handle. A slot in the table holds one reference for the table; a
 * READ that replies from it takes one (tier_get) and drops it after writev (tier_unref).
 * Whoever drops the last reference retires the slot: tier_discard hands the owner
 * straight back (release it now), anyone else puts it on the dead list that tier_reap
 * empties. So no buffer is released while a reply still points into it.
 */
#ifndef KSPEEDFS_FUSE_TIER_H
#define KSPEEDFS_FUSE_TIER_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#define FE_KEY_MAX 20

struct fe_slot {
    struct fe_slot *next; /* bucket chain, then the dead list */
    atomic_int refs;      /* 1 for the table + 1 per reply writing from it */
    atomic_int touched;   /* FE_TOUCHED | FE_SERVED bits */
    uint8_t keylen;
    uint8_t key[FE_KEY_MAX];
    const uint8_t *data;
    size_t len;
    void *owner;
};

struct fe_tier;

struct fe_tier *tier_new(void);
void tier_free(struct fe_tier *t); /* slots left are freed, owners not */
/* ``key`` -> ``data`` owned by ``owner``; replaces what was there (its owner comes back
 * through tier_reap), except a slot the native fetch put with no owner over the same
 * bytes: that one is adopted (it keeps its references and FE_* bits, ``owner`` is set). */
int tier_put(struct fe_tier *t, const uint8_t *key, size_t keylen, const void *data,
             size_t len, void *owner);
/* The native fetch's put: verified bytes it landed, with no owner until Python's
 * tier_put adopts them; -EEXIST (nothing changed) when ``key`` is there already. */
int tier_put_new(struct fe_tier *t, const uint8_t *key, size_t keylen, const void *data,
                 size_t len);
void *tier_discard(struct fe_tier *t, const uint8_t *key, size_t keylen, int *found);
/* A READ replied from the slot since tier_touched last asked for this bit (which clears
 * it): the LRU's second chance. */
#define FE_TOUCHED 1
/* A READ replied from the slot at least once since it was put (never cleared): the
 * prefetcher's "the reader has reached this chunk". */
#define FE_SERVED 2
/* Whether the slot under ``key`` has any of ``bits``; FE_TOUCHED among them is cleared. */
int tier_touched(struct fe_tier *t, const uint8_t *key, size_t keylen, int bits);
size_t tier_reap(struct fe_tier *t, void **owners, size_t max);
size_t tier_clear(struct fe_tier *t, void **owners, size_t max);
size_t tier_count(struct fe_tier *t);
/* A reference to the slot under ``key`` (NULL: not there), marked FE_TOUCHED | FE_SERVED. */
struct fe_slot *tier_get(struct fe_tier *t, const uint8_t *key, size_t keylen);
void tier_unref(struct fe_tier *t, struct fe_slot *s);
int tier_has(struct fe_tier *t, const uint8_t *key, size_t keylen);

#endif
