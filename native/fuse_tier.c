/* fuse_tier.c — the native engine's table of memory-tier buffers (fuse_tier.h). */
#define _GNU_SOURCE
#include "fuse_tier.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "tuning.h"


struct fe_tier {
    struct fe_slot **buckets;
    pthread_mutex_t stripes[FE_STRIPES];
    atomic_size_t slots;
    pthread_mutex_t dead_lock;
    struct fe_slot *dead;
};

struct fe_tier *tier_new(void)
{
    struct fe_tier *t = calloc(1, sizeof *t);
    if (!t)
        return NULL;
    t->buckets = calloc((size_t)1 << FE_BUCKET_BITS, sizeof *t->buckets);
    if (!t->buckets) {
        free(t);
        return NULL;
    }
    for (int i = 0; i < FE_STRIPES; i++)
        pthread_mutex_init(&t->stripes[i], NULL);
    pthread_mutex_init(&t->dead_lock, NULL);
    return t;
}

void tier_free(struct fe_tier *t)
{
    if (!t)
        return;
    for (size_t b = 0; b < ((size_t)1 << FE_BUCKET_BITS); b++)
        for (struct fe_slot *s = t->buckets[b], *next; s; s = next) {
            next = s->next;
            free(s);
        }
    for (struct fe_slot *s = t->dead, *next; s; s = next) {
        next = s->next;
        free(s);
    }
    free(t->buckets);
    free(t);
}




static uint64_t key_hash(const uint8_t *key, size_t keylen)
{
    uint64_t h;
    memcpy(&h, key, 8); /* the key is a digest: already uniform */
    if (keylen > 16) {
        uint32_t b;
        memcpy(&b, key + 16, 4);
        h ^= (uint64_t)(b + 1) * 0x9e3779b97f4a7c15ULL;
    }
    return h;
}

static size_t bucket_of(const uint8_t *key, size_t keylen)
{
    return (size_t)(key_hash(key, keylen) >> (64 - FE_BUCKET_BITS));
}

static pthread_mutex_t *stripe_of(struct fe_tier *t, size_t bucket)
{
    return &t->stripes[bucket & (FE_STRIPES - 1)];
}

/* The slot under ``key`` in bucket ``b`` (stripe held), or NULL; ``prev`` its link. */
static struct fe_slot *find(struct fe_tier *t, size_t b, const uint8_t *key, size_t keylen,
                            struct fe_slot ***link)
{
    struct fe_slot **p = &t->buckets[b];
    for (; *p; p = &(*p)->next)
        if ((*p)->keylen == keylen && memcmp((*p)->key, key, keylen) == 0) {
            if (link)
                *link = p;
            return *p;
        }
    return NULL;
}

/* Drop one reference; the last one retires the slot: returns its owner when the
 * caller may release it now (``keep_owner``), else puts it on the dead list. */
static void *unref(struct fe_tier *t, struct fe_slot *s, int keep_owner)
{
    if (atomic_fetch_sub(&s->refs, 1) != 1)
        return NULL;
    if (keep_owner) {
        void *owner = s->owner;
        free(s);
        return owner;
    }
    pthread_mutex_lock(&t->dead_lock);
    s->next = t->dead;
    t->dead = s;
    pthread_mutex_unlock(&t->dead_lock);
    return NULL;
}

static int put(struct fe_tier *t, const uint8_t *key, size_t keylen, const void *data,
               size_t len, void *owner, int only_new)
{
    if (keylen < 16 || keylen > FE_KEY_MAX)
        return -EINVAL;
    struct fe_slot *s = calloc(1, sizeof *s);
    if (!s)
        return -ENOMEM;
    atomic_init(&s->refs, 1);
    s->keylen = (uint8_t)keylen;
    memcpy(s->key, key, keylen);
    s->data = data;
    s->len = len;
    s->owner = owner;
    size_t b = bucket_of(key, keylen);
    pthread_mutex_t *m = stripe_of(t, b);
    pthread_mutex_lock(m);
    struct fe_slot **link, *old = find(t, b, key, keylen, &link);
    if (old && (only_new || (!old->owner && old->data == data && old->len == len))) {
        if (!only_new)
            old->owner = owner; /* adopted: the native fetch's slot, same bytes */
        pthread_mutex_unlock(m);
        free(s);
        return only_new ? -EEXIST : 0;
    }
    if (old)
        *link = old->next;
    s->next = t->buckets[b];
    t->buckets[b] = s;
    pthread_mutex_unlock(m);
    if (old)
        unref(t, old, 0); /* its owner comes back through fe_tier_reap */
    else
        atomic_fetch_add(&t->slots, 1);
    return 0;
}

int tier_put(struct fe_tier *t, const uint8_t *key, size_t keylen, const void *data,
             size_t len, void *owner)
{
    return put(t, key, keylen, data, len, owner, 0);
}

int tier_put_new(struct fe_tier *t, const uint8_t *key, size_t keylen, const void *data,
                 size_t len)
{
    return put(t, key, keylen, data, len, NULL, 1);
}

void *tier_discard(struct fe_tier *t, const uint8_t *key, size_t keylen, int *found)
{
    *found = 0;
    if (keylen < 16 || keylen > FE_KEY_MAX)
        return NULL;
    size_t b = bucket_of(key, keylen);
    pthread_mutex_t *m = stripe_of(t, b);
    pthread_mutex_lock(m);
    struct fe_slot **link, *s = find(t, b, key, keylen, &link);
    if (s)
        *link = s->next;
    pthread_mutex_unlock(m);
    if (!s)
        return NULL;
    *found = 1;
    atomic_fetch_sub(&t->slots, 1);
    return unref(t, s, 1);
}

int tier_touched(struct fe_tier *t, const uint8_t *key, size_t keylen, int bits)
{
    if (keylen < 16 || keylen > FE_KEY_MAX)
        return 0;
    size_t b = bucket_of(key, keylen);
    pthread_mutex_t *m = stripe_of(t, b);
    pthread_mutex_lock(m);
    struct fe_slot *s = find(t, b, key, keylen, NULL);
    int was = 0;
    if (s)
        was = (bits & FE_TOUCHED) ? atomic_fetch_and(&s->touched, ~FE_TOUCHED)
                                  : atomic_load(&s->touched);
    pthread_mutex_unlock(m);
    return (was & bits) != 0;
}

size_t tier_reap(struct fe_tier *t, void **owners, size_t max)
{
    size_t n = 0;
    pthread_mutex_lock(&t->dead_lock);
    while (t->dead && n < max) {
        struct fe_slot *s = t->dead;
        t->dead = s->next;
        owners[n++] = s->owner;
        free(s);
    }
    pthread_mutex_unlock(&t->dead_lock);
    return n;
}

size_t tier_clear(struct fe_tier *t, void **owners, size_t max)
{
    size_t n = tier_reap(t, owners, max);
    for (size_t b = 0; b < ((size_t)1 << FE_BUCKET_BITS) && n < max; b++) {
        while (t->buckets[b] && n < max) {
            struct fe_slot *s = t->buckets[b];
            t->buckets[b] = s->next;
            owners[n++] = s->owner;
            free(s);
            atomic_fetch_sub(&t->slots, 1);
        }
    }
    return n;
}

size_t tier_count(struct fe_tier *t) { return atomic_load(&t->slots); }

struct fe_slot *tier_get(struct fe_tier *t, const uint8_t *key, size_t keylen)
{
    size_t b = bucket_of(key, keylen);
    pthread_mutex_t *m = stripe_of(t, b);
    pthread_mutex_lock(m);
    struct fe_slot *s = find(t, b, key, keylen, NULL);
    if (s) {
        atomic_fetch_add(&s->refs, 1);
        atomic_fetch_or_explicit(&s->touched, FE_TOUCHED | FE_SERVED, memory_order_relaxed);
    }
    pthread_mutex_unlock(m);
    return s;
}

int tier_has(struct fe_tier *t, const uint8_t *key, size_t keylen)
{
    size_t b = bucket_of(key, keylen);
    pthread_mutex_t *m = stripe_of(t, b);
    pthread_mutex_lock(m);
    int found = find(t, b, key, keylen, NULL) != NULL;
    pthread_mutex_unlock(m);
    return found;
}

void tier_unref(struct fe_tier *t, struct fe_slot *s) { unref(t, s, 0); }
