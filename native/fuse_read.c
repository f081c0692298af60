/* fuse_read.c — READ: the sequential-read bookkeeping (prefetch hints, chunks started
 * here), then every byte from the tier → one reply, else queued for Python or parked
 * on the native fetch; and the tier keys of a chunk's blocks and a small file's extent. */
#define _GNU_SOURCE
#include "fuse_engine_i.h"

#include <errno.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>

static const uint8_t *chunk_key(const struct fe_engine *e, uint64_t k)
{
    return e->ix.chunk_digests + k * 16;
}

/* The sequential-read bookkeeping of cache/prefetch.py ``Prefetcher.advise``, for one
 * handle: whether this read is random, and the chunks to start loading ahead. */
static int advise(struct fe_engine *e, struct fe_handle *fh, uint64_t offset, uint64_t size,
                  uint64_t last, uint64_t file_last, uint64_t *pstart, uint64_t *pstop)
{
    *pstart = *pstop = 0;
    pthread_mutex_lock(&fh->lock);
    fh->run = offset == fh->next_offset ? fh->run + 1 : 0;
    fh->next_offset = offset + size;
    int random = fh->run == 0;
    if (e->opt.prefetch_depth && fh->run >= e->opt.prefetch_trigger) {
        uint64_t start = last + 1;
        if (fh->prefetched_to >= 0 && (uint64_t)fh->prefetched_to + 1 > start)
            start = (uint64_t)fh->prefetched_to + 1;
        uint64_t stop = last + 1 + e->opt.prefetch_depth;
        if (stop > file_last + 1)
            stop = file_last + 1;
        if (start < stop) {
            fh->prefetched_to = (int64_t)stop - 1;
            *pstart = start;
            *pstop = stop;
        }
    }
    pthread_mutex_unlock(&fh->lock);
    return random;
}

struct hit {
    struct iovec iov[FE_MAX_IOV + 1];
    struct fe_slot *held[FE_MAX_IOV];
    int n; /* iovecs used, from 1 */
    int nheld;
    int units;
};

static int hold(struct hit *h, struct fe_slot *s, size_t at, size_t len)
{
    if (h->n > FE_MAX_IOV || at > s->len || len > s->len - at)
        return 0;
    h->held[h->nheld++] = s;
    h->iov[h->n++] = (struct iovec){(void *)(s->data + at), len};
    h->units++;
    return 1;
}

/* The key of a file in one chunk: its one extent's digest; NULL for any other file. */
static const uint8_t *one_extent(const struct fe_index *ix, uint64_t entry)
{
    uint64_t base = ix->data[entry], c = ix->chunk_size, x = ix->ext[entry];
    if (!ix->size[entry] || base / c != (base + ix->size[entry] - 1) / c || x >= ix->extents)
        return NULL;
    return ix->ext_digests + x * 16;
}

/* READ ``rd``, missed, of a file in one chunk (``fe_file_extent``): its one extent started
 * by the native fetch and ``rd`` parked on it (fuse_fetch.h fetch_start_part), when Python
 * routed that chunk and gave C staging slots — it does when small files are read alone
 * (ReadPolicy.small_file: the dataset outgrows the tiers), slots of that limit, so a file
 * larger finds none. Else 0: the caller's. */
int start_small(struct fe_engine *e, struct fe_fetch *f, const struct fe_read *rd)
{
    const uint8_t *key;
    uint32_t len;
    if (fe_file_extent(e, rd->entry, &key, &len) < 0)
        return 0;
    uint64_t c = e->ix.chunk_size, k = e->ix.data[rd->entry] / c;
    return fetch_start_part(f, k, e->ix.data[rd->entry] - k * c, len, key, rd);
}

/* The tier key of block ``b`` of chunk ``k``: the chunk's digest, then ``b`` little-endian
 * (as manifest/model.py block_key). */
static void block_key(const struct fe_engine *e, uint64_t k, uint64_t b, uint8_t key[20])
{
    memcpy(key, chunk_key(e, k), 16);
    uint32_t b32 = (uint32_t)b;
    memcpy(key + 16, &b32, 4);
}

int start_block(struct fe_engine *e, struct fe_fetch *f, const struct fe_read *rd)
{
    const struct fe_index *ix = &e->ix;
    uint64_t B = ix->block_size, c = ix->chunk_size;
    if (!rd->random || !B || !ix->block_digests || !rd->size || rd->entry >= ix->entries ||
        rd->offset >= ix->size[rd->entry])
        return 0;
    uint64_t size = ix->size[rd->entry], base = ix->data[rd->entry];
    uint64_t lo = base + rd->offset;
    uint64_t hi = base + (size - rd->offset < rd->size ? size : rd->offset + rd->size);
    uint64_t k = lo / c, b = (lo - k * c) / B;
    uint8_t key[20];
    uint32_t len;
    if ((hi - 1) / c != k || (hi - 1 - k * c) / B != b ||
        fe_chunk_block(e, k, b, key, &len) < 0)
        return 0;
    return fetch_start_block(f, k, b, b * B, len, key,
                             ix->block_digests + (k * ix->block_stride + b) * 8, rd);
}

/* Bytes [lo, hi) of chunk ``k`` for file ``entry`` from the tier: the chunk, the small
 * file's own extent, or every block under the range. 1: held in ``h``; 0: a miss. */
static int tier_part(struct fe_engine *e, uint64_t entry, uint64_t k, uint64_t lo, uint64_t hi,
                     struct hit *h)
{
    const struct fe_index *ix = &e->ix;
    if (h->nheld >= FE_MAX_IOV)
        return 0;
    struct fe_slot *s = tier_get(e->tier, chunk_key(e, k), 16);
    if (s) {
        if (hold(h, s, lo, hi - lo))
            return 1;
        tier_unref(e->tier, s);
        return 0;
    }
    uint64_t base = ix->data[entry], c = ix->chunk_size;
    const uint8_t *xkey = one_extent(ix, entry);
    if (xkey && (s = tier_get(e->tier, xkey, 16))) {
        if (hold(h, s, k * c + lo - base, hi - lo))
            return 1;
        tier_unref(e->tier, s);
        return 0;
    }
    uint64_t B = ix->block_size;
    if (!B)
        return 0;
    for (uint64_t b = lo / B; b <= (hi - 1) / B; b++) {
        uint8_t key[20];
        block_key(e, k, b, key);
        if (h->nheld >= FE_MAX_IOV || !(s = tier_get(e->tier, key, 20)))
            return 0;
        uint64_t from = lo > b * B ? lo - b * B : 0;
        uint64_t to = (hi < (b + 1) * B ? hi : (b + 1) * B) - b * B;
        if (!hold(h, s, from, to - from)) {
            tier_unref(e->tier, s);
            return 0;
        }
    }
    return 1;
}

static void release_hit(struct fe_engine *e, struct hit *h)
{
    for (int i = 0; i < h->nheld; i++)
        tier_unref(e->tier, h->held[i]);
    h->nheld = 0;
}

/* READ [offset, offset + size) of ``entry``, its chunks first..last: held in ``h`` from
 * the tier (1), or a miss (0, nothing held). */
static int read_hit(struct fe_engine *e, uint64_t entry, uint64_t offset, uint64_t end,
                    uint64_t first, uint64_t last, struct hit *h)
{
    const struct fe_index *ix = &e->ix;
    uint64_t c = ix->chunk_size, base = ix->data[entry];
    h->n = 1;
    h->nheld = 0;
    h->units = 0;
    int hit = 1;
    for (uint64_t k = first; k <= last && hit; k++) {
        uint64_t lo = (base + offset > k * c ? base + offset : k * c) - k * c;
        uint64_t hi = (base + end < (k + 1) * c ? base + end : (k + 1) * c) - k * c;
        hit = tier_part(e, entry, k, lo, hi, h);
    }
    if (!hit)
        release_hit(e, h);
    return hit;
}

/* What a READ of [offset, offset + size) of ``entry`` covers: its end, clipped to the
 * file (``offset >= *end``: nothing), and the chunks first..last it touches. */
static void read_span(const struct fe_engine *e, uint64_t entry, uint64_t offset,
                      uint64_t size, uint64_t *end, uint64_t *first, uint64_t *last)
{
    const struct fe_index *ix = &e->ix;
    uint64_t fsize = ix->size[entry], c = ix->chunk_size, base = ix->data[entry];
    *end = offset + size < fsize ? offset + size : fsize;
    *first = (base + offset) / c;
    *last = *end > offset ? (base + *end - 1) / c : *first;
}

/* A READ of ``bytes`` answered from ``units`` tier buffers, counted in ``c``. */
static void count_hit(struct fe_counters *c, uint64_t bytes, int units)
{
    c->read_hits++;
    c->read_hit_bytes += bytes;
    c->memory_hits += (uint64_t)units;
}

/* Queued READ ``rd`` ([offset, end) over chunks first..last) answered from the tier if it
 * holds them all, counted with the READs answered again; 0: it does not. */
static int answer_again(struct fe_engine *e, const struct fe_read *rd, uint64_t end,
                        uint64_t first, uint64_t last)
{
    struct hit h;
    if (!read_hit(e, rd->entry, rd->offset, end, first, last, &h))
        return 0;
    reply_iov(rd->fd, rd->unique, h.iov, h.n);
    release_hit(e, &h);
    pthread_mutex_lock(&e->alock);
    count_hit(&e->again, end - rd->offset, h.units);
    count_into(&e->again, FE_OP_READ, rd->t0, 0);
    e->again.late_hits++;
    pthread_mutex_unlock(&e->alock);
    return 1;
}

int fe_read_or_park(struct fe_engine *e, const struct fe_read *rd)
{
    if (rd->entry >= e->ix.entries || !S_ISREG(e->ix.mode[rd->entry]))
        return 0; /* (Python's READ tuple: not trusted blindly) */
    uint64_t end, first, last;
    read_span(e, rd->entry, rd->offset, rd->size, &end, &first, &last);
    if (rd->offset >= end)
        return 0;
    if (answer_again(e, rd, end, first, last))
        return 1;
    struct fe_fetch *f = atomic_load(&e->fetch); /* one of its chunks in flight */
    if (!f)
        return 0;
    /* Nothing to park on may also mean its last chunk landed between the two looks: the
     * READ is then answered from the tier, not left to Python for a trio task. */
    return fetch_park(f, first, last, rd) || answer_again(e, rd, end, first, last);
}

int fe_read_from(struct fe_engine *e, const struct fe_read *rd, const uint8_t *key,
                 const uint8_t *buf, uint32_t len)
{
    const uint8_t *xkey;
    uint32_t xlen;
    if (fe_file_extent(e, rd->entry, &xkey, &xlen) < 0 || xlen != len ||
        memcmp(xkey, key, 16) != 0)
        return 0;
    uint64_t end, first, last;
    read_span(e, rd->entry, rd->offset, rd->size, &end, &first, &last);
    if (rd->offset >= end)
        return 0;
    struct iovec iov[2] = {{0}, {(void *)(buf + rd->offset), end - rd->offset}};
    reply_iov(rd->fd, rd->unique, iov, 2);
    pthread_mutex_lock(&e->alock);
    count_hit(&e->again, end - rd->offset, 1);
    count_into(&e->again, FE_OP_READ, rd->t0, 0);
    e->again.late_hits++;
    pthread_mutex_unlock(&e->alock);
    return 1;
}

void fe_read_again(struct fe_engine *e, const struct fe_read *rd)
{
    if (!fe_read_or_park(e, rd))
        enqueue_read(e, rd);
}

int fe_queue(struct fe_engine *e, const struct fe_request *q) { return enqueue(e, q); }

int do_read(struct req *r)
{
    struct fe_engine *e = r->w->e;
    const struct fe_index *ix = &e->ix;
    uint64_t entry;
    if (!valid_entry(e, r->h->nodeid, &entry))
        return -ENOENT;
    if (r->arglen < sizeof(struct fuse_read_in))
        return -EINVAL;
    const struct fuse_read_in *in = (const void *)r->arg;
    uint64_t offset = in->offset, end, first, last;
    read_span(e, entry, offset, in->size, &end, &first, &last);
    if (offset >= end)
        return answer(r, NULL, 0, 0), 0;
    uint64_t file_last = (ix->data[entry] + ix->size[entry] - 1) / ix->chunk_size;
    if (last >= ix->chunks || first > last)
        return -EIO;
    if (file_last >= ix->chunks)
        file_last = ix->chunks - 1;
    struct fe_handle *fh = handle_get(e, in->fh);
    int random = 0;
    uint64_t pstart = 0, pstop = 0;
    if (fh)
        random = advise(e, fh, offset, in->size, last, file_last, &pstart, &pstop);
    struct hit h;
    int queued = 0;
    if (read_hit(e, entry, offset, end, first, last, &h)) {
        count_hit(&r->w->c, end - offset, h.units);
        counted(r, 0);
        worker_reply(r->w, r->h->unique, 0, h.iov, h.n);
        release_hit(e, &h);
    } else {
        struct fe_read rd = {.unique = r->h->unique,
                             .entry = entry,
                             .offset = offset,
                             .size = in->size,
                             .random = random,
                             .t0 = r->t0};
        r->w->c.read_misses++;
        r->w->c.queued++;
        if (read_for_python(r->w, &rd, atomic_load(&e->fetch), first, last) < 0)
            return -ENOMEM;
        queued = QUEUED;
    }
    if (pstop > pstart) {
        /* chunks Python routed start here (fetch_start); from the first that does not,
         * the rest are hinted to Python */
        struct fe_fetch *f = atomic_load(&e->fetch);
        for (uint64_t k = pstart; k < pstop; k++)
            if (!tier_has(e->tier, chunk_key(e, k), 16) && !(f && fetch_start(f, k))) {
                struct fe_request q = {
                    .kind = FE_PREFETCH,
                    .prefetch = {.reached = last, .entry = entry, .first = k, .stop = pstop}};
                r->w->c.prefetch_hints++;
                enqueue(e, &q);
                break;
            }
    }
    return queued;
}

int fe_chunk_block(struct fe_engine *e, uint64_t chunk, uint64_t block, uint8_t key[20],
                   uint32_t *len)
{
    const struct fe_index *ix = &e->ix;
    uint64_t B = ix->block_size;
    if (chunk >= ix->chunks || !B || block > UINT32_MAX || block * B >= ix->chunk_len[chunk])
        return -EINVAL;
    block_key(e, chunk, block, key);
    uint64_t left = ix->chunk_len[chunk] - block * B;
    *len = (uint32_t)(left < B ? left : B);
    return 0;
}

int fe_file_extent(struct fe_engine *e, uint64_t entry, const uint8_t **key, uint32_t *len)
{
    const struct fe_index *ix = &e->ix;
    if (entry >= ix->entries || !S_ISREG(ix->mode[entry]) || ix->size[entry] > UINT32_MAX ||
        !(*key = one_extent(ix, entry)))
        return -EINVAL;
    *len = (uint32_t)ix->size[entry];
    return 0;
}
