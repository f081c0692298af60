/* peer_wait.c — the library's native fetch (peer_wait.h has the map). */
#define _GNU_SOURCE
#include "peer_wait.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

struct wrec { /* one READ out; under w->lock */
    int used, done, abandoned;
    uint32_t gen, qpn; /* qpn: the path's QP it was posted on */
    int stage, peer, path;
    ks_wc wc;
    pthread_cond_t cond;
};

struct wcq {
    ks_engine *ke;
    ks_cq *cq;
    int id, efd;
};

struct wpeer {
    struct fe_path path[FE_PATHS];
    int npaths, turn;
};

struct wslot {
    uint8_t *laddr;
    uint32_t size, lkey[FE_NICS];
};

struct pw {
    const struct ks_capi *api;
    pthread_mutex_t lock;
    uint64_t chunks, *routes; /* chunk → (peer + 1) << 56 | arena offset; 0: none */
    struct wpeer peers[FE_PEERS];
    struct wslot stage[PW_STAGING];
    int stage_free[PW_STAGING], nstage, nstage_free;
    struct wrec recs[PW_MAX];
    int active, stopping;
    struct pw_tally tally[FE_PEERS][FE_PATHS];
    struct fe_sample samples[PW_SAMPLES];
    int nsamples;
    struct wcq cqs[FE_FETCH_ENGINES];
    int ncqs, epfd, stopfd, started;
    pthread_t thread;
};

static void *reaper(void *arg);

static uint64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

/* Everything pw_new made, the reaper not running. */
static void release(struct pw *w)
{
    if (w->epfd >= 0)
        close(w->epfd);
    if (w->stopfd >= 0)
        close(w->stopfd);
    for (int i = 0; i < PW_MAX; i++)
        pthread_cond_destroy(&w->recs[i].cond);
    pthread_mutex_destroy(&w->lock);
    free(w->routes);
    free(w);
}

struct pw *pw_new(uint64_t chunks, const struct ks_capi *api, char *err, size_t errlen)
{
    struct pw *w = calloc(1, sizeof *w);
    uint64_t *routes = calloc(chunks ? chunks : 1, sizeof *routes);
    if (!w || !routes) {
        free(w);
        free(routes);
        snprintf(err, errlen, "peer_wait: out of memory");
        return NULL;
    }
    w->api = api;
    w->chunks = chunks;
    w->routes = routes;
    pthread_mutex_init(&w->lock, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC); /* deadlines are monotonic */
    for (int i = 0; i < PW_MAX; i++)
        pthread_cond_init(&w->recs[i].cond, &ca);
    pthread_condattr_destroy(&ca);
    w->epfd = epoll_create1(EPOLL_CLOEXEC);
    w->stopfd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    struct epoll_event ev = {.events = EPOLLIN, .data.u32 = FE_FETCH_ENGINES};
    if (w->epfd < 0 || w->stopfd < 0 ||
        epoll_ctl(w->epfd, EPOLL_CTL_ADD, w->stopfd, &ev) < 0 ||
        pthread_create(&w->thread, NULL, reaper, w) != 0) {
        snprintf(err, errlen, "peer_wait: %s", strerror(errno));
        release(w);
        return NULL;
    }
    w->started = 1;
    return w;
}

int pw_engine(struct pw *w, ks_engine *ke, const char **why)
{
    int rc = 0;
    pthread_mutex_lock(&w->lock);
    for (int i = 0; i < w->ncqs; i++)
        if (w->cqs[i].ke == ke)
            goto out;
    if (w->ncqs == FE_FETCH_ENGINES) {
        *why = "peer_wait: too many soft engines";
        rc = -ENOSPC;
        goto out;
    }
    struct wcq *q = &w->cqs[w->ncqs];
    rc = w->api->cq_open(ke, 4 * PW_MAX, &q->cq, &q->id, &q->efd, why);
    if (rc < 0)
        goto out;
    q->ke = ke;
    struct epoll_event ev = {.events = EPOLLIN, .data.u32 = (uint32_t)w->ncqs};
    if (epoll_ctl(w->epfd, EPOLL_CTL_ADD, q->efd, &ev) < 0) {
        rc = -errno;
        *why = "peer_wait: epoll_ctl";
        w->api->cq_close(ke, q->cq, why);
        goto out;
    }
    w->ncqs++;
out:
    pthread_mutex_unlock(&w->lock);
    return rc;
}

int pw_staging(struct pw *w, void *laddr, uint32_t size, const uint32_t *lkeys, int nlkeys)
{
    if (nlkeys < 1 || nlkeys > FE_NICS)
        return -EINVAL;
    pthread_mutex_lock(&w->lock);
    int rc = -ENOSPC;
    if (w->nstage < PW_STAGING) {
        struct wslot *s = &w->stage[w->nstage];
        s->laddr = laddr;
        s->size = size;
        memcpy(s->lkey, lkeys, (size_t)nlkeys * sizeof *lkeys);
        w->stage_free[w->nstage_free++] = w->nstage++;
        rc = 0;
    }
    pthread_mutex_unlock(&w->lock);
    return rc;
}

int pw_peer(struct pw *w, int peer, const struct fe_path *paths, int npaths)
{
    if (peer < 0 || peer >= FE_PEERS || npaths < 0 || npaths > FE_PATHS)
        return -EINVAL;
    for (int i = 0; i < npaths; i++)
        if (paths[i].nic >= FE_NICS)
            return -EINVAL;
    pthread_mutex_lock(&w->lock);
    struct wpeer *p = &w->peers[peer];
    memcpy(p->path, paths, (size_t)npaths * sizeof *paths);
    p->npaths = npaths;
    pthread_mutex_unlock(&w->lock);
    return 0;
}

int pw_route(struct pw *w, uint64_t k, int peer, uint64_t offset)
{
    if (k >= w->chunks || peer >= FE_PEERS || offset >= (1ULL << 56))
        return -EINVAL;
    pthread_mutex_lock(&w->lock);
    w->routes[k] = peer < 0 ? 0 : (uint64_t)(peer + 1) << 56 | offset;
    pthread_mutex_unlock(&w->lock);
    return 0;
}

void pw_unroute(struct pw *w)
{
    pthread_mutex_lock(&w->lock);
    memset(w->routes, 0, w->chunks * sizeof *w->routes);
    for (int i = 0; i < FE_PEERS; i++)
        w->peers[i].npaths = 0;
    pthread_mutex_unlock(&w->lock);
}

static struct wcq *cq_of(struct pw *w, ks_engine *ke) /* under w->lock */
{
    for (int i = 0; i < w->ncqs; i++)
        if (w->cqs[i].ke == ke)
            return &w->cqs[i];
    return NULL;
}

/* Under w->lock: record ``i`` and its staging slot free again. */
static void rec_free(struct pw *w, int i)
{
    struct wrec *r = &w->recs[i];
    w->stage_free[w->nstage_free++] = r->stage;
    r->used = 0;
    w->active--;
}

/* Under w->lock: what READ ``r`` of ``len`` bytes ended in, told to its path's tally;
 * an ok one's time (``ns``) kept as a sample for the hedger (pw_samples). */
static void tally(struct pw *w, const struct wrec *r, int status, uint32_t len, uint64_t ns)
{
    struct pw_tally *t = &w->tally[r->peer][r->path];
    t->peer = r->peer;
    t->path = r->path;
    t->qpn = r->qpn;
    if (status == FE_FETCH_OK) {
        t->ok++;
        t->bytes += len;
        if (w->nsamples < PW_SAMPLES)
            w->samples[w->nsamples++] = (struct fe_sample){.peer = r->peer,
                                                           .path = r->path,
                                                           .len = len,
                                                           .took_ns = ns};
    } else if (status == FE_FETCH_LATE)
        t->late++;
    else
        t->failed++;
}

int pw_read(struct pw *w, uint64_t k, uint64_t offset, uint32_t len, const uint8_t *want,
            void *dest, uint64_t timeout_ns)
{
    if (k >= w->chunks || !len || offset >= (1ULL << 56))
        return PW_BAD;
    pthread_mutex_lock(&w->lock);
    uint64_t route = w->routes[k];
    int peer = (int)(route >> 56) - 1;
    struct wpeer *p = peer >= 0 ? &w->peers[peer] : NULL;
    if (!p || !p->npaths || w->stopping) {
        pthread_mutex_unlock(&w->lock);
        return PW_NO_ROUTE;
    }
    int si = -1, fi = 0; /* a free staging slot large enough */
    for (; fi < w->nstage_free; fi++)
        if (w->stage[w->stage_free[fi]].size >= len) {
            si = w->stage_free[fi];
            break;
        }
    int i = 0;
    while (i < PW_MAX && w->recs[i].used)
        i++;
    int pi = p->turn++ % p->npaths;
    struct fe_path path = p->path[pi];
    struct wcq *q = cq_of(w, path.ke);
    if (si < 0 || i == PW_MAX || !q) {
        pthread_mutex_unlock(&w->lock);
        return si < 0 || i == PW_MAX ? PW_BUSY : PW_NO_ROUTE;
    }
    w->stage_free[fi] = w->stage_free[--w->nstage_free];
    struct wrec *r = &w->recs[i];
    r->used = 1; /* field by field: the condition variable stays where it is */
    r->done = r->abandoned = 0;
    r->gen++;
    r->qpn = path.qpn;
    r->stage = si;
    r->peer = peer;
    r->path = pi;
    w->active++;
    uint64_t wr_id = (uint64_t)r->gen << 32 | (uint32_t)i;
    struct wslot s = w->stage[si];
    ks_cq *cq = q->cq;
    pthread_mutex_unlock(&w->lock);

    uint64_t t0 = now_ns();
    const char *why = "";
    uint64_t raddr = path.raddr + (route & ((1ULL << 56) - 1)) + offset;
    int rc = fr_post_read(w->api, path.ke, cq, path.qpn, wr_id, s.laddr, s.lkey[path.nic],
                          raddr, path.rkey, len, &why);
    pthread_mutex_lock(&w->lock);
    if (rc < 0) { /* never posted */
        rec_free(w, i);
        w->routes[k] = 0;
        tally(w, r, PW_POST, len, 0);
        pthread_mutex_unlock(&w->lock);
        return PW_POST;
    }
    uint64_t end = t0 + timeout_ns;
    struct timespec dl = {.tv_sec = (time_t)(end / 1000000000ull),
                          .tv_nsec = (long)(end % 1000000000ull)};
    while (!r->done && pthread_cond_timedwait(&r->cond, &w->lock, &dl) != ETIMEDOUT)
        ;
    if (!r->done) { /* late: the reaper frees it when its WC comes */
        r->abandoned = 1;
        w->routes[k] = 0;
        tally(w, r, FE_FETCH_LATE, len, 0);
        pthread_mutex_unlock(&w->lock);
        return FE_FETCH_LATE;
    }
    ks_wc wc = r->wc;
    pthread_mutex_unlock(&w->lock);

    int status = fr_verify(&wc, s.laddr, len, want, 16);
    if (status == FE_FETCH_OK)
        memcpy(dest, s.laddr, len);
    uint64_t ns = now_ns() - t0;
    pthread_mutex_lock(&w->lock);
    tally(w, r, status, len, ns);
    if (status != FE_FETCH_OK)
        w->routes[k] = 0; /* a stale or dead route: the next read goes to Python */
    rec_free(w, i);
    pthread_mutex_unlock(&w->lock);
    return status;
}

int pw_tallies(struct pw *w, struct pw_tally *out, int max)
{
    int n = 0;
    pthread_mutex_lock(&w->lock);
    for (int p = 0; p < FE_PEERS; p++)
        for (int q = 0; q < FE_PATHS; q++) {
            struct pw_tally *t = &w->tally[p][q];
            if (n == max || !(t->ok || t->failed || t->late))
                continue;
            out[n++] = *t;
            memset(t, 0, sizeof *t);
        }
    pthread_mutex_unlock(&w->lock);
    return n;
}

int pw_samples(struct pw *w, struct fe_sample *out, int max)
{
    pthread_mutex_lock(&w->lock);
    int n = w->nsamples < max ? w->nsamples : max;
    memcpy(out, w->samples, sizeof *out * (size_t)n);
    w->nsamples = 0;
    pthread_mutex_unlock(&w->lock);
    return n;
}

/* One WC: its caller woken, or (it gave up) its record freed. */
static void complete(struct pw *w, const ks_wc *wc)
{
    int i = (int)(uint32_t)wc->wr_id;
    uint32_t gen = (uint32_t)(wc->wr_id >> 32);
    pthread_mutex_lock(&w->lock);
    struct wrec *r = i >= 0 && i < PW_MAX ? &w->recs[i] : NULL;
    if (r && r->used && r->gen == gen && !r->done) {
        if (r->abandoned)
            rec_free(w, i);
        else {
            r->done = 1;
            r->wc = *wc;
            pthread_cond_signal(&r->cond);
        }
    }
    pthread_mutex_unlock(&w->lock);
}

static void *reaper(void *arg)
{
    struct pw *w = arg;
    pthread_setname_np(pthread_self(), "ks-peerwait"); /* top -H, bench: by role */
    ks_wc wcs[64];
    for (;;) {
        struct epoll_event evs[FE_FETCH_ENGINES + 1];
        int n = epoll_wait(w->epfd, evs, FE_FETCH_ENGINES + 1, -1);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            break;
        for (int j = 0; j < n; j++) {
            uint32_t which = evs[j].data.u32;
            if (which == FE_FETCH_ENGINES)
                return NULL;
            struct wcq *q = &w->cqs[which]; /* polling it empty re-arms its eventfd */
            const char *why;
            int got;
            while ((got = w->api->cq_poll(q->ke, q->id, wcs, 64, &why)) > 0)
                for (int k = 0; k < got; k++)
                    complete(w, &wcs[k]);
        }
    }
    return NULL;
}

int pw_stop(struct pw *w, int timeout_ms)
{
    pthread_mutex_lock(&w->lock);
    w->stopping = 1;
    pthread_mutex_unlock(&w->lock);
    uint64_t end = now_ns() + (uint64_t)timeout_ms * 1000000ull;
    for (;;) {
        pthread_mutex_lock(&w->lock);
        int active = w->active;
        pthread_mutex_unlock(&w->lock);
        if (!active || now_ns() >= end)
            break;
        poll(NULL, 0, 5);
    }
    if (w->started) {
        uint64_t one = 1;
        ssize_t wr = write(w->stopfd, &one, sizeof one);
        (void)wr;
        pthread_join(w->thread, NULL);
        w->started = 0;
    }
    pthread_mutex_lock(&w->lock);
    int left = w->active;
    for (int i = 0; i < w->ncqs; i++) {
        const char *why;
        if (w->cqs[i].cq && w->api->cq_close(w->cqs[i].ke, w->cqs[i].cq, &why) == 0)
            w->cqs[i].cq = NULL; /* else a READ is still out: the engine's close frees it */
    }
    pthread_mutex_unlock(&w->lock);
    return left;
}

void pw_free(struct pw *w)
{
    if (!w)
        return;
    if (w->started)
        pw_stop(w, 0);
    release(w);
}
