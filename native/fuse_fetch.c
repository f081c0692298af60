/* fuse_fetch.c — the native chunk fetch (fuse_fetch.h has the map). */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include "fuse_engine.h"
#include "fuse_engine_i.h"
#include "fuse_fetch.h"
#include "fuse_tier.h"

struct parked {
    struct parked *next;
    struct fe_read read;
};

struct own {       /* what a C-started fetch's FE_FETCHED names */
    uint32_t slot; /* Python's id of its landing slot; a part's: the
                                     * index of its staging slot in f->stage */
    int peer, path;
    uint64_t t0, deadline; /* CLOCK_MONOTONIC ns; deadline 0: none */
    int late;              /* FE_FETCH_LATE sent */
    uint64_t chunk, entry; /* a part's (FE_PART): its chunk, and the file it is */
};

struct rec { /* one fetch in flight; all fields under f->lock */
    int used;
    uint32_t gen;       /* in the WR id beside the index: a stale WC is ignored */
    uint64_t k, cookie; /* k: FE_NO_CHUNK for a part (an extent, a block):
                                     * copied out of laddr once verified, and put under
                                     * key[0..keylen) */
    uint8_t *laddr;
    uint32_t len;
    int orphan;                /* its bytes came another way (fetch_unpark): no READ
                                     * parks on it any more */
    uint8_t key[20], keylen;   /* its tier key (a chunk's is f->digests + k * 16) */
    uint8_t want[16], wantlen; /* its digest: xxh3-128 (16), or xxh3-64 (8: a block) */
    struct parked *parked;
    struct own own; /* a C-started fetch's (cookie & FE_OWN) */
};

struct landed { /* an extent's buffer in the tier, until Python takes it */
    struct landed *next;
    uint64_t cookie;
    uint8_t *buf;
    uint32_t len;
};

struct fcq { /* a fetch CQ on one soft engine */
    ks_engine *ke;
    ks_cq *cq;
    int id, efd;
};

struct peer { /* fetch_peer's; under f->lock */
    struct fe_path path[FE_PATHS];
    int npaths, turn;
    uint64_t limit_ns, part_limit_ns[FE_SIZE_CLASSES];
};

struct slot {
    uint32_t id;
    uint8_t *laddr;
    uint32_t lkey[FE_NICS];
};

struct fe_fetch {
    struct fe_engine *e;
    struct fe_tier *t;
    const uint8_t *digests;
    const uint32_t *chunk_len;
    uint64_t chunks;
    uint64_t *routes;            /* chunk → (peer + 1) << 56 | arena offset; 0: none */
    struct peer peers[FE_PEERS]; /* under lock, as routes and slots */
    struct slot slots[FE_SLOTS];
    int nslots;
    struct slot stage[FE_STAGING]; /* fetch_staging's, each C's for good (id: its size) */
    int stage_free[FE_STAGING];    /* indexes into stage of the free ones */
    int nstage, nstage_free;
    uint64_t own_seq;
    const struct ks_capi *api;
    pthread_mutex_t lock;
    struct rec recs[FE_FETCH_MAX]; /* under lock */
    int active;                    /* records used; under lock */
    atomic_int nactive;            /* the same, read without the lock by fetch_park */
    int stopping;                  /* under lock: no more posts */
    struct fcq cqs[FE_FETCH_ENGINES];
    atomic_int ncqs; /* cqs[0..ncqs) published; added under lock */
    int epfd, stopfd, kickfd;
    atomic_int idle; /* the thread sleeps with no deadline to watch */
    pthread_t thread;
    int started;
    struct landed *landed;                /* under lock */
    atomic_int keep;                      /* fetch_keep's */
    struct fe_sample tally[FE_TALLY_MAX]; /* under lock, as the three below */
    int ntally, tally_sent;               /* tally_sent: FE_FETCH_TALLY queued, not taken */
    uint64_t tally_since;                 /* the oldest sample's time */
    struct fe_fetch_counters c;           /* under lock */
};

static void *fetch_main(void *arg);

struct fe_fetch *fetch_new(struct fe_engine *e, struct fe_tier *t,
                           const uint8_t *chunk_digests, const uint32_t *chunk_len,
                           uint64_t chunks, const struct ks_capi *api, char *err,
                           size_t errlen)
{
    struct fe_fetch *f = calloc(1, sizeof *f);
    uint64_t *routes = calloc(chunks ? chunks : 1, sizeof *routes);
    if (!f || !routes) {
        free(f);
        free(routes);
        snprintf(err, errlen, "fetch: out of memory");
        return NULL;
    }
    f->e = e;
    f->t = t;
    f->digests = chunk_digests;
    f->chunk_len = chunk_len;
    f->chunks = chunks;
    f->routes = routes;
    f->api = api;
    atomic_init(&f->keep, 1);
    pthread_mutex_init(&f->lock, NULL);
    f->epfd = epoll_create1(EPOLL_CLOEXEC);
    f->stopfd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    f->kickfd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    struct epoll_event ev = {.events = EPOLLIN, .data.u32 = FE_FETCH_ENGINES};
    struct epoll_event kick = {.events = EPOLLIN, .data.u32 = FE_FETCH_ENGINES + 1};
    if (f->epfd < 0 || f->stopfd < 0 || f->kickfd < 0 ||
        epoll_ctl(f->epfd, EPOLL_CTL_ADD, f->stopfd, &ev) < 0 ||
        epoll_ctl(f->epfd, EPOLL_CTL_ADD, f->kickfd, &kick) < 0 ||
        pthread_create(&f->thread, NULL, fetch_main, f) != 0) {
        snprintf(err, errlen, "fetch: %s", strerror(errno));
        if (f->epfd >= 0)
            close(f->epfd);
        if (f->stopfd >= 0)
            close(f->stopfd);
        if (f->kickfd >= 0)
            close(f->kickfd);
        pthread_mutex_destroy(&f->lock);
        free(f->routes);
        free(f);
        return NULL;
    }
    f->started = 1;
    return f;
}

int fetch_engine(struct fe_fetch *f, ks_engine *ke, const char **why)
{
    pthread_mutex_lock(&f->lock);
    int n = atomic_load(&f->ncqs), rc = 0;
    for (int i = 0; i < n; i++)
        if (f->cqs[i].ke == ke)
            goto out;
    if (n == FE_FETCH_ENGINES) {
        rc = -ENOSPC;
        *why = "fetch: too many soft engines";
        goto out;
    }
    struct fcq *q = &f->cqs[n];
    rc = f->api->cq_open(ke, 4 * FE_FETCH_MAX, &q->cq, &q->id, &q->efd, why);
    if (rc < 0)
        goto out;
    q->ke = ke;
    struct epoll_event ev = {.events = EPOLLIN, .data.u32 = (uint32_t)n};
    if (epoll_ctl(f->epfd, EPOLL_CTL_ADD, q->efd, &ev) < 0) {
        rc = -errno;
        *why = "fetch: epoll_ctl";
        f->api->cq_close(ke, q->cq, why);
        goto out;
    }
    atomic_store(&f->ncqs, n + 1);
out:
    pthread_mutex_unlock(&f->lock);
    return rc;
}

static struct fcq *cq_of(struct fe_fetch *f, ks_engine *ke)
{
    int n = atomic_load(&f->ncqs);
    for (int i = 0; i < n; i++)
        if (f->cqs[i].ke == ke)
            return &f->cqs[i];
    return NULL;
}

/* The record of chunk ``k`` in flight (under f->lock), or NULL. */
static struct rec *rec_of(struct fe_fetch *f, uint64_t k)
{
    for (int i = 0; i < FE_FETCH_MAX; i++)
        if (f->recs[i].used && f->recs[i].k == k)
            return &f->recs[i];
    return NULL;
}

/* The record of the part with tier key ``key`` in flight (under f->lock), or NULL. */
static struct rec *part_rec_of(struct fe_fetch *f, const uint8_t *key, size_t keylen)
{
    for (int i = 0; i < FE_FETCH_MAX; i++)
        if (f->recs[i].used && f->recs[i].k == FE_NO_CHUNK && f->recs[i].keylen == keylen &&
            memcmp(f->recs[i].key, key, keylen) == 0)
            return &f->recs[i];
    return NULL;
}

/* Take record ``i`` out (under f->lock): its parked READs to the caller. */
static struct parked *rec_end(struct fe_fetch *f, int i)
{
    struct rec *r = &f->recs[i];
    struct parked *p = r->parked;
    r->used = 0;
    r->parked = NULL;
    f->active--;
    atomic_store(&f->nactive, f->active);
    return p;
}

/* Hand parked READs ``p`` on (no lock held): with ``again``, fe_read_again (answered from
 * the tier, or parked on another of their chunks still in flight, or queued for Python),
 * else queued for Python; counted; freed. Returns how many. */
static int hand_on(struct fe_fetch *f, struct parked *p, int again)
{
    int n = 0;
    while (p) {
        struct parked *next = p->next;
        if (again)
            fe_read_again(f->e, &p->read);
        else
            fe_queue(f->e, &(struct fe_request){.kind = FE_READ, .read = p->read});
        free(p);
        p = next;
        n++;
    }
    pthread_mutex_lock(&f->lock);
    f->c.answered += (uint64_t)n;
    pthread_mutex_unlock(&f->lock);
    return n;
}

/* The FE_FETCHED event of a fetch (a C-started one's also names its slot, peer, path and
 * start: fetch_slot). */
static void event(struct fe_fetch *f, uint64_t k, uint64_t cookie, int status,
                  const struct own *own)
{
    struct fe_request ev = {
        .kind = FE_FETCHED,
        .fetched = {.cookie = cookie, .chunk = k, .status = status, .peer = -1}};
    struct fe_fetched *x = &ev.fetched;
    if (cookie & FE_OWN) {
        if (cookie & FE_PART) {
            x->slot = own->entry;
            x->chunk = own->chunk;
        } else {
            x->slot = own->slot;
        }
        x->peer = own->peer;
        x->path = own->path;
        x->t0 = own->t0;
    }
    fe_queue(f->e, &ev);
}

/* Queue the event for Python, then hand the READs on (behind the event). */
static void finish(struct fe_fetch *f, uint64_t k, uint64_t cookie, int status,
                   struct parked *p, int again, const struct own *own)
{
    event(f, k, cookie, status, own);
    hand_on(f, p, again);
    pthread_mutex_lock(&f->lock);
    if (status == FE_FETCH_OK)
        f->c.landed++;
    else if (status == FE_FETCH_EXISTS)
        f->c.redundant++; /* a hedge or Python's load won: not a failure */
    else
        f->c.failed++;
    pthread_mutex_unlock(&f->lock);
}

/* One signaled RDMA READ on fetch CQ ``q`` (no lock held): fetch_read.h. */
static int post_read(struct fe_fetch *f, ks_engine *ke, struct fcq *q, uint32_t qpn,
                     uint64_t wr_id, void *laddr, uint32_t lkey, uint64_t raddr, uint32_t rkey,
                     uint32_t len, const char **why)
{
    return fr_post_read(f->api, ke, q->cq, qpn, wr_id, laddr, lkey, raddr, rkey, len, why);
}

/* Under f->lock: READ ``p`` parked on record ``r`` (answered when it ends), counted. */
static void park_on(struct fe_fetch *f, struct rec *r, struct parked *p)
{
    p->next = r->parked;
    r->parked = p;
    f->c.parked++;
}

/* Under f->lock: the peer chunk ``k``'s route names, when that peer has an UP path
 * (``*peer`` its number, ``*off`` the chunk's offset in its arena), else NULL. */
static struct peer *routed(struct fe_fetch *f, uint64_t k, int *peer, uint64_t *off)
{
    uint64_t route = f->routes[k];
    *peer = (int)(route >> 56) - 1;
    *off = route & ((1ULL << 56) - 1);
    struct peer *p = *peer >= 0 ? &f->peers[*peer] : NULL;
    return p && p->npaths ? p : NULL;
}

/* Under f->lock: a record for a fetch of chunk ``k`` (FE_NO_CHUNK: a part under ``key``),
 * verified against ``want``, landing at ``laddr``, with READs ``parked`` on it and ``own``
 * (a C-started fetch's), counted as posted; its index, or -1 when FE_FETCH_MAX are in
 * flight. Its WR id is wr_id_of(f, index). */
static int rec_open(struct fe_fetch *f, uint64_t k, const uint8_t *key, size_t keylen,
                    const uint8_t *want, size_t wantlen, uint64_t cookie, void *laddr,
                    uint32_t len, struct parked *parked, struct own own)
{
    int i = 0;
    while (i < FE_FETCH_MAX && f->recs[i].used)
        i++;
    if (i == FE_FETCH_MAX)
        return -1;
    struct rec *r = &f->recs[i];
    r->used = 1;
    r->gen++;
    r->k = k;
    r->cookie = cookie;
    r->laddr = laddr;
    r->len = len;
    r->orphan = 0;
    memcpy(r->key, key, keylen);
    r->keylen = (uint8_t)keylen;
    memcpy(r->want, want, wantlen);
    r->wantlen = (uint8_t)wantlen;
    r->parked = parked;
    r->own = own;
    if (parked)
        f->c.parked++;
    f->active++;
    atomic_store(&f->nactive, f->active);
    f->c.posted++;
    return i;
}

/* The WR id of record ``i``'s READ: its generation beside its index (a stale WC is
 * ignored by complete). */
static uint64_t wr_id_of(const struct fe_fetch *f, int i)
{
    return (uint64_t)f->recs[i].gen << 32 | (uint32_t)i;
}

/* fetch_post and fetch_post_part: a record for chunk ``k`` (or, FE_NO_CHUNK, for the part
 * under tier key ``key``, digest ``want``, with the caller's READ ``read`` parked on it),
 * and its READ. */
static int post(struct fe_fetch *f, ks_engine *ke, uint32_t qpn, uint64_t k,
                const uint8_t *key, size_t keylen, const uint8_t *want, size_t wantlen,
                const struct fe_read *read, uint64_t cookie, void *laddr, uint32_t lkey,
                uint64_t raddr, uint32_t rkey, uint32_t len, const char **why)
{
    struct fcq *q = cq_of(f, ke);
    if (!q) {
        *why = "fetch_post: no fetch CQ on that engine (fetch_engine)";
        return -EINVAL;
    }
    struct parked *own = NULL; /* ``read``, parked before the READ can complete */
    if (read) {
        if (!(own = malloc(sizeof *own))) {
            *why = "fetch_post: out of memory";
            return -ENOMEM;
        }
        own->read = *read;
        own->next = NULL;
    }
    pthread_mutex_lock(&f->lock);
    if (k == FE_NO_CHUNK ? part_rec_of(f, key, keylen) != NULL : rec_of(f, k) != NULL) {
        pthread_mutex_unlock(&f->lock);
        free(own);
        *why = "fetch_post: in flight";
        return -EALREADY;
    }
    int free_i = f->stopping ? -1
                             : rec_open(f, k, key, keylen, want, wantlen, cookie, laddr, len,
                                        own, (struct own){0});
    if (free_i < 0) {
        pthread_mutex_unlock(&f->lock);
        free(own);
        *why = f->stopping ? "fetch_post: stopped" : "fetch_post: too many in flight";
        return f->stopping ? -ESHUTDOWN : -EAGAIN;
    }
    uint64_t wr_id = wr_id_of(f, free_i);
    pthread_mutex_unlock(&f->lock);

    int rc = post_read(f, ke, q, qpn, wr_id, laddr, lkey, raddr, rkey, len, why);
    if (rc < 0) { /* never posted: READs that parked meanwhile go to Python */
        pthread_mutex_lock(&f->lock);
        f->c.posted--;
        struct parked *p = rec_end(f, free_i), **link = &p;
        if (own) { /* ``read`` stays the caller's: it answers it */
            f->c.parked--;
            while (*link != own)
                link = &(*link)->next;
            *link = own->next;
            free(own);
        }
        pthread_mutex_unlock(&f->lock);
        hand_on(f, p, 0);
    }
    return rc;
}

int fetch_post(struct fe_fetch *f, ks_engine *ke, uint32_t qpn, uint64_t k, uint64_t cookie,
               void *laddr, uint32_t lkey, uint64_t raddr, uint32_t rkey, uint32_t len,
               const char **why)
{
    if (k >= f->chunks || !len) {
        *why = "fetch_post: no such chunk";
        return -EINVAL;
    }
    return post(f, ke, qpn, k, f->digests + k * 16, 16, f->digests + k * 16, 16, NULL, cookie,
                laddr, lkey, raddr, rkey, len, why);
}

int fetch_post_part(struct fe_fetch *f, ks_engine *ke, uint32_t qpn, const uint8_t *key,
                    size_t keylen, const uint8_t *want, size_t wantlen,
                    const struct fe_read *read, uint64_t cookie, void *laddr, uint32_t lkey,
                    uint64_t raddr, uint32_t rkey, uint32_t len, const char **why)
{
    if (!len || (keylen != 16 && keylen != 20) || (wantlen != 16 && wantlen != 8)) {
        *why = "fetch_post_part: empty, or a key or digest of another size";
        return -EINVAL;
    }
    return post(f, ke, qpn, FE_NO_CHUNK, key, keylen, want, wantlen, read, cookie, laddr, lkey,
                raddr, rkey, len, why);
}

int fetch_peer(struct fe_fetch *f, int peer, const struct fe_path *paths, int npaths,
               uint64_t limit_ns, const uint64_t *part_limits)
{
    if (peer < 0 || peer >= FE_PEERS || npaths < 0 || npaths > FE_PATHS)
        return -EINVAL;
    for (int i = 0; i < npaths; i++)
        if (paths[i].nic >= FE_NICS || !cq_of(f, paths[i].ke))
            return -EINVAL;
    pthread_mutex_lock(&f->lock);
    struct peer *p = &f->peers[peer];
    memcpy(p->path, paths, sizeof *paths * (size_t)npaths);
    p->npaths = npaths;
    p->limit_ns = limit_ns;
    for (int c = 0; c < FE_SIZE_CLASSES; c++)
        p->part_limit_ns[c] = part_limits ? part_limits[c] : 0;
    pthread_mutex_unlock(&f->lock);
    return 0;
}

int fetch_route(struct fe_fetch *f, uint64_t k, int peer, uint64_t offset)
{
    if (k >= f->chunks || peer >= FE_PEERS || offset >> 56)
        return -EINVAL;
    pthread_mutex_lock(&f->lock);
    f->routes[k] = peer < 0 ? 0 : (uint64_t)(peer + 1) << 56 | offset;
    pthread_mutex_unlock(&f->lock);
    return 0;
}

void fetch_unroute(struct fe_fetch *f)
{
    pthread_mutex_lock(&f->lock);
    memset(f->routes, 0, sizeof *f->routes * f->chunks);
    memset(f->peers, 0, sizeof f->peers);
    pthread_mutex_unlock(&f->lock);
}

int fetch_slot(struct fe_fetch *f, uint32_t id, void *laddr, const uint32_t *lkeys, int nlkeys)
{
    if (nlkeys < 0 || nlkeys > FE_NICS)
        return -EINVAL;
    pthread_mutex_lock(&f->lock);
    int rc = -ENOSPC;
    if (f->nslots < FE_SLOTS) {
        struct slot *s = &f->slots[f->nslots++];
        s->id = id;
        s->laddr = laddr;
        memset(s->lkey, 0, sizeof s->lkey);
        memcpy(s->lkey, lkeys, sizeof *lkeys * (size_t)nlkeys);
        rc = 0;
    }
    pthread_mutex_unlock(&f->lock);
    return rc;
}

/* Record ``i``, a fetch C starts from peer ``p``'s path ``pi`` into slot ``s``, is open
 * (under f->lock, released here): counted, the path's turn taken, the fetch thread woken
 * for its deadline, and its READ of ``len`` bytes at ``off`` of the peer's arena posted.
 * post_read's result: below 0, the caller takes the record back. */
static int own_post(struct fe_fetch *f, struct peer *p, int pi, int i, const struct slot *s,
                    uint64_t off, uint32_t len)
{
    f->own_seq++;
    p->turn++;
    f->c.started++;
    struct fe_path path = p->path[pi];
    uint64_t wr_id = wr_id_of(f, i);
    int watch = f->recs[i].own.deadline != 0;
    pthread_mutex_unlock(&f->lock);
    if (watch && atomic_exchange(&f->idle, 0)) { /* its deadline needs the thread awake */
        uint64_t one = 1;
        ssize_t wr = write(f->kickfd, &one, sizeof one);
        (void)wr;
    }
    const char *why;
    return post_read(f, path.ke, cq_of(f, path.ke) /* (fetch_peer checked it) */, path.qpn,
                     wr_id, s->laddr, s->lkey[path.nic], path.raddr + off, path.rkey, len,
                     &why);
}

int fetch_staging(struct fe_fetch *f, void *laddr, uint32_t size, const uint32_t *lkeys,
                  int nlkeys)
{
    if (nlkeys < 0 || nlkeys > FE_NICS || !size)
        return -EINVAL;
    pthread_mutex_lock(&f->lock);
    int rc = -ENOSPC;
    if (f->nstage < FE_STAGING) {
        struct slot *s = &f->stage[f->nstage];
        s->id = size;
        s->laddr = laddr;
        memset(s->lkey, 0, sizeof s->lkey);
        memcpy(s->lkey, lkeys, sizeof *lkeys * (size_t)nlkeys);
        f->stage_free[f->nstage_free++] = f->nstage++;
        rc = 0;
    }
    pthread_mutex_unlock(&f->lock);
    return rc;
}

/* The hedger's size class of a READ of ``len`` bytes (cluster/hedge.py size_class). */
static int size_class(uint32_t len)
{
    int bits = len > 1 ? 32 - __builtin_clz(len - 1) : 0; /* (len - 1).bit_length() */
    int c = (bits - 11) / 2;
    return bits < 11 ? 0 : c < FE_SIZE_CLASSES - 1 ? c : FE_SIZE_CLASSES - 1;
}

/* fetch_start_part and fetch_start_block: a part (``key``, verified against ``want``)
 * whose FE_FETCHED names ``tag`` (the file; the block) and carries ``flags`` (FE_BLOCK)
 * in its cookie. */
static int start_part(struct fe_fetch *f, uint64_t k, uint64_t offset, uint32_t len,
                      const uint8_t *key, size_t keylen, const uint8_t *want, size_t wantlen,
                      uint64_t tag, uint64_t flags, const struct fe_read *read)
{
    if (k >= f->chunks || !len || offset + len > f->chunk_len[k])
        return 0;
    struct parked *mine = malloc(sizeof *mine);
    if (!mine)
        return 0;
    mine->read = *read;
    mine->next = NULL;
    pthread_mutex_lock(&f->lock);
    struct rec *r = part_rec_of(f, key, keylen);
    if (r) { /* in flight: the READ waits for it (unless a hedge
                                     * answered that fetch's READs: then Python's) */
        int park = !r->orphan;
        if (park)
            park_on(f, r, mine);
        pthread_mutex_unlock(&f->lock);
        if (!park)
            free(mine);
        return park;
    }
    int peer;
    uint64_t at;
    struct peer *p = routed(f, k, &peer, &at);
    int si = f->nstage_free ? f->stage_free[f->nstage_free - 1] : -1;
    if (!p || si < 0 || f->stage[si].id < len || f->stopping) {
        pthread_mutex_unlock(&f->lock);
        free(mine);
        return 0;
    }
    struct slot s = f->stage[si];
    int pi = p->turn % p->npaths;
    uint64_t now = fe_now_ns();
    uint64_t limit = p->part_limit_ns[size_class(len)];
    struct own own = {.slot = (uint32_t)si,
                      .peer = peer,
                      .path = pi,
                      .t0 = now,
                      .deadline = limit ? now + limit : 0,
                      .chunk = k,
                      .entry = tag};
    int free_i = rec_open(f, FE_NO_CHUNK, key, keylen, want, wantlen,
                          FE_OWN | FE_PART | flags | (f->own_seq + 1), s.laddr, len, mine,
                          own);
    if (free_i < 0) {
        pthread_mutex_unlock(&f->lock);
        free(mine);
        return 0;
    }
    f->nstage_free--;
    f->c.started_parts++;
    if (own_post(f, p, pi, free_i, &s, at + offset, len) >= 0)
        return 1;
    /* never posted: the slot back, the route gone; ``read`` stays the caller's, READs
     * that parked on it meanwhile go to Python */
    pthread_mutex_lock(&f->lock);
    f->c.posted--;
    f->c.started--;
    f->c.started_parts--;
    f->c.parked--;
    struct parked *parked = rec_end(f, free_i), **link = &parked;
    while (*link != mine)
        link = &(*link)->next;
    *link = mine->next;
    free(mine);
    f->routes[k] = 0;
    f->stage_free[f->nstage_free++] = si;
    pthread_mutex_unlock(&f->lock);
    hand_on(f, parked, 0);
    return 0;
}

int fetch_start_part(struct fe_fetch *f, uint64_t k, uint64_t offset, uint32_t len,
                     const uint8_t *key, const struct fe_read *read)
{
    return start_part(f, k, offset, len, key, 16, key, 16, read->entry, 0, read);
}

int fetch_start_block(struct fe_fetch *f, uint64_t k, uint64_t b, uint64_t offset,
                      uint32_t len, const uint8_t *key, const uint8_t *want,
                      const struct fe_read *read)
{
    return start_part(f, k, offset, len, key, 20, want, 8, b, FE_BLOCK, read);
}

int fetch_start(struct fe_fetch *f, uint64_t k)
{
    if (k >= f->chunks)
        return 0;
    pthread_mutex_lock(&f->lock);
    if (rec_of(f, k)) {
        pthread_mutex_unlock(&f->lock);
        return 1; /* in flight: nothing to start */
    }
    int peer;
    uint64_t at;
    struct peer *p = routed(f, k, &peer, &at);
    uint32_t len = f->chunk_len[k];
    if (!p || !f->nslots || f->stopping || !len) {
        pthread_mutex_unlock(&f->lock);
        return 0;
    }
    struct slot s = f->slots[f->nslots - 1];
    int pi = p->turn % p->npaths;
    uint64_t now = fe_now_ns();
    struct own own = {.slot = s.id,
                      .peer = peer,
                      .path = pi,
                      .t0 = now,
                      .deadline = p->limit_ns ? now + p->limit_ns : 0};
    const uint8_t *digest = f->digests + k * 16;
    int free_i = rec_open(f, k, digest, 16, digest, 16, FE_OWN | (f->own_seq + 1), s.laddr,
                          len, NULL, own);
    if (free_i < 0) {
        pthread_mutex_unlock(&f->lock);
        return 0;
    }
    f->nslots--;
    if (own_post(f, p, pi, free_i, &s, at, len) >= 0)
        return 1;
    /* never posted: the slot back, the route gone, READs parked meanwhile to Python */
    pthread_mutex_lock(&f->lock);
    f->c.posted--;
    f->c.started--;
    struct parked *parked = rec_end(f, free_i);
    f->routes[k] = 0;
    if (f->nslots < FE_SLOTS)
        f->slots[f->nslots++] = s;
    pthread_mutex_unlock(&f->lock);
    hand_on(f, parked, 0);
    return 0;
}

void *fetch_landed(struct fe_fetch *f, uint64_t cookie, uint32_t *len)
{
    uint8_t *buf = NULL;
    pthread_mutex_lock(&f->lock);
    for (struct landed **l = &f->landed; *l; l = &(*l)->next)
        if ((*l)->cookie == cookie) {
            struct landed *x = *l;
            *l = x->next;
            buf = x->buf;
            *len = x->len;
            free(x);
            break;
        }
    pthread_mutex_unlock(&f->lock);
    return buf;
}

int fetch_park(struct fe_fetch *f, uint64_t first, uint64_t last, const struct fe_read *rd)
{
    if (!atomic_load(&f->nactive) || first > last || last >= f->chunks)
        return 0;
    struct parked *p = malloc(sizeof *p);
    if (!p)
        return 0;
    p->read = *rd;
    struct rec *wait = NULL;
    pthread_mutex_lock(&f->lock); /* (a record ends under it, after its tier put) */
    for (uint64_t k = first; k <= last; k++) {
        if (tier_has(f->t, f->digests + k * 16, 16))
            continue;
        struct rec *r = rec_of(f, k);
        if (!r || r->orphan) { /* missing and not in flight: Python loads it */
            wait = NULL;
            break;
        }
        if (!wait)
            wait = r;
    }
    if (wait)
        park_on(f, wait, p);
    pthread_mutex_unlock(&f->lock);
    if (!wait)
        free(p);
    return wait != NULL;
}

int fetch_unpark(struct fe_fetch *f, uint64_t cookie)
{
    struct parked *p = NULL;
    struct rec *r = NULL;
    pthread_mutex_lock(&f->lock);
    for (int i = 0; i < FE_FETCH_MAX && !r; i++)
        if (f->recs[i].used && f->recs[i].cookie == cookie)
            r = &f->recs[i];
    if (r) {
        p = r->parked;
        r->parked = NULL;
        r->orphan = 1;
    }
    pthread_mutex_unlock(&f->lock);
    return hand_on(f, p, 1);
}

/* A part's (an extent's, a block's) verified bytes out of its staging slot into a buffer
 * of its own (the fault of new memory is paid here, not on the trio thread), put in the
 * tier with no owner: the buffer, or NULL with ``*status`` FE_FETCH_NOMEM or
 * FE_FETCH_EXISTS. From FE_ALIGN_MIN on the buffer starts on a page: the kernel copies a
 * reply a page at a time, and a source that starts mid-page is two short copies per page
 * (the memory tier's page_aligned, kspeedfs/cache/memory.py, says what it costs). */
static void *copy_part(struct fe_fetch *f, const uint8_t *key, size_t keylen,
                       const uint8_t *laddr, uint32_t len, int *status)
{
    void *buf = NULL;
    if (len < FE_ALIGN_MIN)
        buf = malloc(len);
    else if (posix_memalign(&buf, 4096, len))
        buf = NULL;
    if (!buf) {
        *status = FE_FETCH_NOMEM;
        return NULL;
    }
    memcpy(buf, laddr, len);
    if (tier_put_new(f->t, key, keylen, buf, len) < 0) {
        free(buf);
        *status = FE_FETCH_EXISTS;
        return NULL;
    }
    return buf;
}

/* copy_part, the buffer kept for Python (fetch_landed) ahead of the FE_FETCHED event. */
static int put_part(struct fe_fetch *f, uint64_t cookie, const uint8_t *key, size_t keylen,
                    const uint8_t *laddr, uint32_t len)
{
    struct landed *x = malloc(sizeof *x);
    if (!x)
        return FE_FETCH_NOMEM;
    int status = FE_FETCH_OK;
    void *buf = copy_part(f, key, keylen, laddr, len, &status);
    if (!buf) {
        free(x);
        return status;
    }
    *x = (struct landed){.cookie = cookie, .buf = buf, .len = len};
    pthread_mutex_lock(&f->lock);
    x->next = f->landed;
    f->landed = x;
    pthread_mutex_unlock(&f->lock);
    return FE_FETCH_OK;
}

/* The tally for Python (FE_FETCH_TALLY), unless one is queued and not taken or no sample
 * waits; under f->lock: 1 when the caller queues it (after unlocking). */
static int tally_due(struct fe_fetch *f, uint64_t now)
{
    if (f->tally_sent || !f->ntally ||
        (f->ntally < FE_TALLY_EVERY && now - f->tally_since < FE_TALLY_NS))
        return 0;
    f->tally_sent = 1;
    return 1;
}

static void tally_event(struct fe_fetch *f)
{
    fe_queue(f->e, &(struct fe_request){.kind = FE_FETCHED,
                                        .fetched = {.chunk = FE_NO_CHUNK,
                                                    .status = FE_FETCH_TALLY,
                                                    .peer = -1}});
}

/* Whether record ``i``, a verified part, may end in a sample for Python's tally instead
 * of an FE_FETCHED: a part C started that Python holds no record of (not LATE) while the
 * tally has room. Its LATE and orphan marks change on this thread only, the room only
 * grows. */
static int sampled(struct fe_fetch *f, int i)
{
    pthread_mutex_lock(&f->lock);
    const struct rec *r = &f->recs[i];
    int ok = (r->cookie & (FE_OWN | FE_PART)) == (FE_OWN | FE_PART) && !r->own.late &&
             !r->orphan && f->ntally < FE_TALLY_MAX;
    pthread_mutex_unlock(&f->lock);
    return ok;
}

/* End record ``i`` (``sampled``) in a sample for the tally (FE_FETCH_TALLY): with ``buf``,
 * the part kept (copy_part: its READs answered from the tier, ``buf`` and ``key`` in the
 * sample for Python to adopt); without, not kept: its READs answered from the staging
 * slot ``laddr`` (the kernel's reply copy puts the file in its page cache, which serves
 * re-reads; the memory tier would evict it before an epoch came back to it). Either way
 * the staging slot is free again and no FE_FETCHED is sent (docs/design.md, "Small files
 * from peers, not kept", and "Kept extents told in batches"). */
static void sample_end(struct fe_fetch *f, int i, const uint8_t *key, size_t keylen,
                       const uint8_t *laddr, uint32_t len, void *buf)
{
    uint64_t now = fe_now_ns();
    pthread_mutex_lock(&f->lock);
    struct own own = f->recs[i].own;
    struct parked *p = rec_end(f, i);
    if (!f->ntally)
        f->tally_since = now;
    struct fe_sample *x = &f->tally[f->ntally++];
    *x = (struct fe_sample){.peer = own.peer,
                            .path = own.path,
                            .len = len,
                            .took_ns = now - own.t0,
                            .buf = buf};
    if (buf) {
        memcpy(x->key, key, keylen);
        x->keylen = (uint8_t)keylen;
    }
    pthread_mutex_unlock(&f->lock);
    int n = 0;
    if (buf)
        n = hand_on(f, p, 1); /* (counted there) */
    while (p && !buf) {       /* answered before the slot is free: a READ of another file
                               * sharing the digest is answered from the tier or goes to
                               * Python */
        struct parked *next = p->next;
        if (!fe_read_from(f->e, &p->read, key, laddr, len))
            fe_read_again(f->e, &p->read);
        free(p);
        p = next;
        n++;
    }
    pthread_mutex_lock(&f->lock);
    f->stage_free[f->nstage_free++] = (int)own.slot;
    if (!buf) {
        f->c.answered += (uint64_t)n;
        f->c.unkept++;
    }
    f->c.landed++;
    f->c.tallied++;
    int due = tally_due(f, now);
    pthread_mutex_unlock(&f->lock);
    if (due)
        tally_event(f);
}

/* A verified part C started, told in the tally rather than by an FE_FETCHED when it may
 * be (``sampled``): an extent kept or not, as fetch_keep says; a random read's block
 * (``cookie`` FE_BLOCK) always kept, as Python keeps the blocks it loads. 0: not done, it
 * ends as before (``*status`` FE_FETCH_EXISTS or FE_FETCH_NOMEM when its copy failed). */
static int end_sampled(struct fe_fetch *f, int i, uint64_t cookie, const uint8_t *key,
                       size_t keylen, const uint8_t *laddr, uint32_t len, int *status)
{
    int kept = (cookie & FE_BLOCK) || atomic_load(&f->keep);
    if (!sampled(f, i))
        return 0;
    void *buf = kept ? copy_part(f, key, keylen, laddr, len, status) : NULL;
    if (kept && !buf)
        return 0;
    sample_end(f, i, key, keylen, laddr, len, buf);
    return 1;
}

void fetch_keep(struct fe_fetch *f, int keep) { atomic_store(&f->keep, keep != 0); }

int fetch_tally(struct fe_fetch *f, struct fe_sample *out, int max)
{
    pthread_mutex_lock(&f->lock);
    int n = f->ntally < max ? f->ntally : max;
    memcpy(out, f->tally, sizeof *out * (size_t)n);
    memmove(f->tally, f->tally + n, sizeof *out * (size_t)(f->ntally - n));
    f->ntally -= n;
    if (!f->ntally)
        f->tally_sent = 0;
    pthread_mutex_unlock(&f->lock);
    return n;
}

/* One WC of a fetch READ: verify, put, answer. */
static void complete(struct fe_fetch *f, const ks_wc *wc)
{
    int i = (int)(uint32_t)wc->wr_id;
    uint32_t gen = (uint32_t)(wc->wr_id >> 32);
    pthread_mutex_lock(&f->lock);
    struct rec *r = i >= 0 && i < FE_FETCH_MAX ? &f->recs[i] : NULL;
    if (!r || !r->used || r->gen != gen) {
        pthread_mutex_unlock(&f->lock);
        return; /* abandoned by fetch_stop */
    }
    uint64_t k = r->k, cookie = r->cookie;
    uint8_t *laddr = r->laddr, key[20], want[16];
    uint32_t len = r->len;
    size_t keylen = r->keylen, wantlen = r->wantlen;
    struct own own = r->own;
    memcpy(key, r->key, keylen);
    memcpy(want, r->want, wantlen);
    pthread_mutex_unlock(&f->lock);

    int status = fr_verify(wc, laddr, len, want, wantlen);
    if (status == FE_FETCH_OK && k == FE_NO_CHUNK &&
        end_sampled(f, i, cookie, key, keylen, laddr, len, &status))
        return;
    if (status == FE_FETCH_OK) {
        if (k != FE_NO_CHUNK) {
            if (tier_put_new(f->t, key, keylen, laddr, len) < 0)
                status = FE_FETCH_EXISTS; /* Python put it meanwhile: its copy serves */
        } else
            status = put_part(f, cookie, key, keylen, laddr, len);
    }
    pthread_mutex_lock(&f->lock);
    struct parked *p = rec_end(f, i);
    if ((cookie & FE_OWN) && status != FE_FETCH_OK && status != FE_FETCH_EXISTS)
        f->routes[cookie & FE_PART ? own.chunk : k] = 0; /* a stale or dead route: the
                                                             * next hint goes to Python */
    if ((cookie & (FE_OWN | FE_PART)) == (FE_OWN | FE_PART))
        f->stage_free[f->nstage_free++] = (int)own.slot; /* its bytes are copied out */
    pthread_mutex_unlock(&f->lock);
    finish(f, k, cookie, status, p, status == FE_FETCH_OK || status == FE_FETCH_EXISTS, &own);
}

/* FE_FETCH_LATE for each C-started fetch past its deadline (once; it goes on); returns
 * the epoll timeout until the next check: FE_LATE_TICK_MS while one with a deadline is
 * out (a deadline is the peer's hedging threshold, ≥ 2 ms and ~20-100 ms for a chunk
 * here: a tick of 5 ms is within its noise), else -1; and the tally (FE_FETCH_TALLY)
 * when its oldest sample is FE_TALLY_NS old, the same tick while one waits. */
static int late_check(struct fe_fetch *f)
{
    struct late {
        uint64_t k, cookie;
        struct own own;
    } late[16];
    int n = 0, waiting = 0;
    atomic_store(&f->idle, 1); /* before the scan: fetch_start kicks after it */
    uint64_t now = fe_now_ns();
    pthread_mutex_lock(&f->lock);
    int due = tally_due(f, now);
    waiting = f->ntally && !f->tally_sent; /* (samples come on this thread only) */
    for (int i = 0; i < FE_FETCH_MAX; i++) {
        struct rec *r = &f->recs[i];
        if (!r->used || !(r->cookie & FE_OWN) || !r->own.deadline || r->own.late)
            continue;
        if (r->own.deadline > now || n == 16) {
            waiting = 1;
            continue;
        }
        r->own.late = 1;
        late[n++] = (struct late){r->k, r->cookie, r->own};
    }
    pthread_mutex_unlock(&f->lock);
    if (due)
        tally_event(f);
    for (int i = 0; i < n; i++)
        event(f, late[i].k, late[i].cookie, FE_FETCH_LATE, &late[i].own);
    if (!waiting)
        return -1;
    atomic_store(&f->idle, 0);
    return FE_LATE_TICK_MS;
}

static void *fetch_main(void *arg)
{
    struct fe_fetch *f = arg;
    pthread_setname_np(pthread_self(), "ks-fetch"); /* top -H, bench: by role */
    fe_reply_thread(f->e);                          /* it answers parked READs */
    ks_wc wcs[64];
    for (;;) {
        struct epoll_event evs[FE_FETCH_ENGINES + 2];
        int n = epoll_wait(f->epfd, evs, FE_FETCH_ENGINES + 2, late_check(f));
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            break;
        int stop = 0;
        for (int j = 0; j < n; j++) {
            uint32_t which = evs[j].data.u32;
            if (which == FE_FETCH_ENGINES) {
                stop = 1;
                continue;
            }
            if (which == FE_FETCH_ENGINES + 1) { /* a deadline to watch: late_check */
                uint64_t v;
                ssize_t rd = read(f->kickfd, &v, sizeof v);
                (void)rd;
                continue;
            }
            struct fcq *q = &f->cqs[which]; /* polling it empty re-arms its eventfd */
            const char *why;
            int got;
            while ((got = f->api->cq_poll(q->ke, q->id, wcs, 64, &why)) > 0)
                for (int w = 0; w < got; w++)
                    complete(f, &wcs[w]);
        }
        if (stop)
            break;
    }
    return NULL;
}

int fetch_stop(struct fe_fetch *f, int timeout_ms)
{
    pthread_mutex_lock(&f->lock);
    f->stopping = 1;
    pthread_mutex_unlock(&f->lock);
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) { /* the thread completes what is out, if it comes */
        if (!atomic_load(&f->nactive))
            break;
        struct timespec t;
        clock_gettime(CLOCK_MONOTONIC, &t);
        if ((t.tv_sec - t0.tv_sec) * 1000 + (t.tv_nsec - t0.tv_nsec) / 1000000 >= timeout_ms)
            break;
        poll(NULL, 0, 5);
    }
    if (f->started) {
        uint64_t one = 1;
        ssize_t wr = write(f->stopfd, &one, sizeof one);
        (void)wr;
        pthread_join(f->thread, NULL);
        f->started = 0;
    }
    pthread_mutex_lock(&f->lock);
    int left = f->active;
    for (int i = 0; i < FE_FETCH_MAX; i++) {
        if (!f->recs[i].used)
            continue;
        uint64_t k = f->recs[i].k, cookie = f->recs[i].cookie;
        struct own own = f->recs[i].own;
        struct parked *p = rec_end(f, i);
        pthread_mutex_unlock(&f->lock);
        finish(f, k, cookie, FE_FETCH_STOPPED, p, 0, &own);
        pthread_mutex_lock(&f->lock);
    }
    int n = atomic_load(&f->ncqs);
    for (int i = 0; i < n; i++) {
        const char *why;
        if (f->cqs[i].cq && f->api->cq_close(f->cqs[i].ke, f->cqs[i].cq, &why) == 0)
            f->cqs[i].cq = NULL; /* else a READ is still out: the engine's close frees it */
    }
    pthread_mutex_unlock(&f->lock);
    return left;
}

void fetch_free(struct fe_fetch *f)
{
    if (!f)
        return;
    if (f->started)
        fetch_stop(f, 0);
    while (f->landed) { /* never taken: no thread reads the tier any more */
        struct landed *x = f->landed;
        f->landed = x->next;
        free(x->buf);
        free(x);
    }
    for (int i = 0; i < f->ntally; i++) /* the same */
        free(f->tally[i].buf);
    close(f->epfd);
    close(f->stopfd);
    close(f->kickfd);
    pthread_mutex_destroy(&f->lock);
    free(f->routes);
    free(f);
}

void fetch_counters(struct fe_fetch *f, struct fe_fetch_counters *c)
{
    pthread_mutex_lock(&f->lock);
    *c = f->c;
    pthread_mutex_unlock(&f->lock);
}
