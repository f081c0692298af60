/* fuse_engine.c — an engine's life: created over a mount's fd, INIT answered (or a
 * predecessor's adopted), the tier for Python, the counters summed, the native fetch
 * enabled, and torn down (fuse_engine.h says what and why; fuse_engine_i.h maps the
 * other files).
 */
#define _GNU_SOURCE
#include "fuse_engine_i.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

void set_err(char *err, size_t errlen, const char *fmt, ...)
{
    if (!err || !errlen)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

struct fe_engine *fe_create(int fd, const struct fe_index *ix, const struct fe_options *opt,
                            char *err, size_t errlen)
{
    struct fe_engine *e = calloc(1, sizeof *e);
    if (!e) {
        set_err(err, errlen, "out of memory");
        return NULL;
    }
    e->fd = fd;
    e->ring_slot = -1;
    e->ix = *ix;
    e->opt = *opt;
    e->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    e->tier = tier_new();
    e->nlink = calloc(ix->entries ? ix->entries : 1, sizeof *e->nlink);
    if (e->efd < 0 || !e->tier || !e->nlink) {
        set_err(err, errlen, "engine setup: %s", strerror(errno ? errno : ENOMEM));
        e->fd = -1; /* still the caller's */
        fe_destroy(e);
        return NULL;
    }
    pthread_mutex_init(&e->qlock, NULL);
    pthread_mutex_init(&e->alock, NULL);
    pthread_mutex_init(&e->hlock, NULL);
    pthread_mutex_init(&e->rlock, NULL);
    pthread_cond_init(&e->rcond, NULL);
    pthread_mutex_init(&e->slock, NULL);
    pthread_cond_init(&e->scond, NULL);
    e->blksize = opt->blksize ? opt->blksize
                              : (uint32_t)(ix->block_size ? ix->block_size : ix->chunk_size);
    return e;
}

int fe_eventfd(const struct fe_engine *e) { return e->efd; }
int fe_running(const struct fe_engine *e) { return atomic_load(&e->live) > 0; }

void fe_negotiated(const struct fe_engine *e, uint32_t *minor, uint64_t *flags,
                   uint32_t *max_pages, uint32_t *max_readahead)
{
    *minor = e->minor;
    *flags = e->flags;
    *max_pages = e->max_pages;
    *max_readahead = e->max_readahead;
}

/* ---------------------------------------------------------- the tier, for Python */

int fe_tier_put(struct fe_engine *e, const uint8_t *key, size_t keylen, const void *data,
                size_t len, void *owner)
{
    return tier_put(e->tier, key, keylen, data, len, owner);
}

void *fe_tier_discard(struct fe_engine *e, const uint8_t *key, size_t keylen, int *found)
{
    return tier_discard(e->tier, key, keylen, found);
}

int fe_tier_touched(struct fe_engine *e, const uint8_t *key, size_t keylen, int bits)
{
    return tier_touched(e->tier, key, keylen, bits);
}

size_t fe_tier_reap(struct fe_engine *e, void **owners, size_t max)
{
    return tier_reap(e->tier, owners, max);
}

size_t fe_tier_clear(struct fe_engine *e, void **owners, size_t max)
{
    return tier_clear(e->tier, owners, max);
}

size_t fe_tier_count(struct fe_engine *e) { return tier_count(e->tier); }

int fe_init(struct fe_engine *e, char *err, size_t errlen)
{
    uint8_t *buf = malloc(FE_REQ_BUF);
    if (!buf)
        return -ENOMEM;
    ssize_t n;
    do
        n = read(e->fd, buf, FE_REQ_BUF);
    while (n < 0 && errno == EINTR);
    int rc = 0;
    const struct fuse_in_header *h = (const void *)buf;
    if (n < (ssize_t)(sizeof *h + 16) || h->opcode != FUSE_INIT) {
        set_err(err, errlen, "no INIT from the kernel (%s)",
                n < 0 ? strerror(errno) : "short");
        rc = n < 0 ? -errno : -EPROTO;
        goto out;
    }
    struct fuse_init_in in = {0};
    memcpy(&in, h + 1, (size_t)n - sizeof *h < sizeof in ? (size_t)n - sizeof *h : sizeof in);
    struct fuse_init_out o = {.major = FUSE_KERNEL_VERSION,
                              .minor = FUSE_KERNEL_MINOR_VERSION};
    if (in.major != FUSE_KERNEL_VERSION || in.minor < 31) {
        reply_buf(e->fd, h->unique, &o, sizeof o);
        set_err(err, errlen, "kernel FUSE %u.%u: need 7.31 or later", in.major, in.minor);
        rc = -EPROTO;
        goto out;
    }
    uint64_t offered = in.flags | (in.flags & FUSE_INIT_EXT ? (uint64_t)in.flags2 << 32 : 0);
    uint64_t wanted = FUSE_ASYNC_READ | FUSE_PARALLEL_DIROPS | FUSE_DO_READDIRPLUS |
                      FUSE_MAX_PAGES | FUSE_CACHE_SYMLINKS | FUSE_INIT_EXT;
    if (e->opt.uring && (offered & FE_FUSE_OVER_IO_URING) && ring_probe())
        wanted |= FE_FUSE_OVER_IO_URING; /* the kernel offers it only with enable_uring=Y */
    uint64_t flags = offered & wanted;
    uint32_t pages = e->opt.max_pages ? e->opt.max_pages : 256;
    o.minor = in.minor < FUSE_KERNEL_MINOR_VERSION ? in.minor : FUSE_KERNEL_MINOR_VERSION;
    o.max_readahead = in.max_readahead;
    o.flags = (uint32_t)flags;
    o.flags2 = (uint32_t)(flags >> 32);
    o.max_background = (uint16_t)(e->opt.max_background ? e->opt.max_background : 64);
    o.congestion_threshold = (uint16_t)(e->opt.congestion_threshold
                                            ? e->opt.congestion_threshold
                                            : o.max_background * 3 / 4);
    o.max_write = FE_MAX_WRITE;
    o.time_gran = 1;
    o.max_pages = (uint16_t)pages;
    if (reply_buf(e->fd, h->unique, &o, sizeof o) < 0) {
        set_err(err, errlen, "INIT reply: %s", strerror(errno));
        rc = -EIO;
        goto out;
    }
    e->minor = o.minor;
    e->flags = flags;
    e->uring = (flags & FE_FUSE_OVER_IO_URING) != 0;
    e->max_pages = flags & FUSE_MAX_PAGES ? pages : 32;
    e->max_readahead = o.max_readahead;
out:
    free(buf);
    return rc;
}

void fe_adopt(struct fe_engine *e, uint32_t minor, uint64_t flags, uint32_t max_pages,
              uint32_t max_readahead)
{
    e->minor = minor;
    e->flags = flags;
    e->max_pages = max_pages ? max_pages : 32;
    e->max_readahead = max_readahead;
}

static void add_counters(struct fe_counters *sum, const struct fe_counters *c)
{
    {
        for (int op = 0; op < FE_NOPS; op++) {
            sum->count[op] += c->count[op];
            sum->errors[op] += c->errors[op];
            sum->ns[op] += c->ns[op];
            for (int b = 0; b < FE_BUCKETS; b++)
                sum->buckets[op][b] += c->buckets[op][b];
        }
        sum->read_hits += c->read_hits;
        sum->read_hit_bytes += c->read_hit_bytes;
        sum->memory_hits += c->memory_hits;
        sum->read_misses += c->read_misses;
        sum->queued += c->queued;
        sum->prefetch_hints += c->prefetch_hints;
        sum->late_hits += c->late_hits;
        sum->resent += c->resent;
        sum->ring_requests += c->ring_requests;
        sum->ring_copy_bytes += c->ring_copy_bytes;
        sum->ring_copy_ns += c->ring_copy_ns;
        sum->ring_lost += c->ring_lost;
        sum->gate_waits += c->gate_waits;
        sum->shared_requests += c->shared_requests;
        sum->gate_opened_tasks += c->gate_opened_tasks;
        sum->gate_opened_requests += c->gate_opened_requests;
        sum->gate_crowded += c->gate_crowded;
    }
}

void fe_counters(struct fe_engine *e, struct fe_counters *sum)
{
    memset(sum, 0, sizeof *sum);
    for (int i = 0; i < e->nworkers; i++)
        add_counters(sum, &e->workers[i].c); /* racy reads of plain u64s */
    for (int i = 0; i < e->nqueues; i++)
        add_counters(sum, &e->queues[i].w.c);
    sum->spliced = atomic_load_explicit(&e->spliced, memory_order_relaxed);
    sum->spliced_bytes = atomic_load_explicit(&e->spliced_bytes, memory_order_relaxed);
    pthread_mutex_lock(&e->alock);
    add_counters(sum, &e->again);
    pthread_mutex_unlock(&e->alock);
    struct fe_fetch *f = atomic_load(&e->fetch);
    if (f) {
        struct fe_fetch_counters fc;
        fetch_counters(f, &fc);
        sum->fetch_posted = fc.posted;
        sum->fetch_landed = fc.landed;
        sum->fetch_failed = fc.failed;
        sum->fetch_redundant = fc.redundant;
        sum->fetch_parked = fc.parked;
        sum->fetch_answered = fc.answered;
        sum->fetch_started = fc.started;
        sum->fetch_started_parts = fc.started_parts;
        sum->fetch_unkept = fc.unkept;
        sum->fetch_tallied = fc.tallied;
    }
}

int fe_fetch_enable(struct fe_engine *e, const struct ks_capi *api, char *err, size_t errlen)
{
    if (atomic_load(&e->fetch))
        return 0;
    if (!api || api->abi != KS_CAPI_ABI) {
        set_err(err, errlen, "fetch: the soft engine's C API is not ABI %d", KS_CAPI_ABI);
        return -EINVAL;
    }
    struct fe_fetch *f = fetch_new(e, e->tier, e->ix.chunk_digests, e->ix.chunk_len,
                                   e->ix.chunks, api, err, errlen);
    if (!f)
        return -ENOMEM;
    atomic_store(&e->fetch, f);
    return 0;
}

struct fe_fetch *fe_fetcher(struct fe_engine *e) { return atomic_load(&e->fetch); }

void fe_destroy(struct fe_engine *e)
{
    if (!e)
        return;
    if (e->nqueues) { /* joined already, unless fe_start failed half-way */
        ring_signal_stop(e);
        ring_join(e);
    }
    ring_free(e);
    for (int i = 0; i < e->nworkers; i++) {
        struct fe_worker *w = &e->workers[i];
        if (i && w->fd >= 0)
            close(w->fd);
        free(w->in);
        free(w->out);
    }
    free(e->workers);
    for (uint32_t i = 0; i < e->nhslots; i++)
        if (e->hslots[i]) {
            pthread_mutex_destroy(&e->hslots[i]->lock);
            free(e->hslots[i]);
        }
    free(e->hslots);
    if (e->fd >= 0)
        close(e->fd);
    if (e->efd >= 0)
        close(e->efd);
    free(e->q);
    free(e->nlink);
    fetch_free(atomic_load(&e->fetch)); /* before the tier: it puts into it */
    tier_free(e->tier);
    free(e);
}
