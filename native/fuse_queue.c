/* fuse_queue.c — the queue for Python: what C cannot answer (READ misses, xattrs,
 * prefetch hints, the native fetch's events), with an eventfd per engine that trio waits
 * on; or a miss parked on the native fetch instead (fuse_fetch.h). */
#define _GNU_SOURCE
#include "fuse_engine_i.h"

#include <errno.h>
#include <stdlib.h>
#include <unistd.h>

void wake(struct fe_engine *e)
{
    uint64_t one = 1;
    ssize_t rc = write(e->efd, &one, sizeof one);
    (void)rc; /* EAGAIN: the counter is already non-zero */
}

int enqueue(struct fe_engine *e, const struct fe_request *q)
{
    pthread_mutex_lock(&e->qlock);
    if (e->qlen == e->qcap) {
        size_t cap = e->qcap ? e->qcap * 2 : 256;
        struct fe_request *nq = malloc(cap * sizeof *nq);
        if (!nq) {
            pthread_mutex_unlock(&e->qlock);
            return -ENOMEM;
        }
        for (size_t i = 0; i < e->qlen; i++)
            nq[i] = e->q[(e->qhead + i) % e->qcap];
        free(e->q);
        e->q = nq;
        e->qcap = cap;
        e->qhead = 0;
    }
    e->q[(e->qhead + e->qlen) % e->qcap] = *q;
    e->qlen++;
    pthread_mutex_unlock(&e->qlock);
    wake(e);
    return 0;
}

int enqueue_read(struct fe_engine *e, const struct fe_read *rd)
{
    return enqueue(e, &(struct fe_request){.kind = FE_READ, .read = *rd});
}

/* The fd or ring token the request ``w`` holds is answered on once Python has it: its
 * ring entry, if any, is Python's from now on (before another thread can answer it). */
static int python_fd(struct fe_worker *w)
{
    if (!w->ent)
        return w->fd;
    atomic_store(&w->ent->state, ENT_PY);
    return ring_token(w->ent);
}

/* ``rc`` of queueing the request ``w`` holds: on failure its ring entry is C's again
 * (the caller answers it). */
static int queued(struct fe_worker *w, int rc)
{
    if (rc < 0 && w->ent)
        atomic_store(&w->ent->state, ENT_C);
    return rc;
}

/* Queue READ ``rd`` for Python, to be answered on the fd or ring entry it came from;
 * or, when ``fetch`` has every chunk of [first, last] the tier lacks in flight, park it
 * there (fuse_fetch.h: answered by the fetch thread, or queued for Python if a chunk
 * does not land); or, a small file's READ, park it on its extent's fetch started here
 * (``start_small``). */
int read_for_python(struct fe_worker *w, struct fe_read *rd, struct fe_fetch *fetch,
                    uint64_t first, uint64_t last)
{
    rd->fd = python_fd(w);
    if (fetch && (fetch_park(fetch, first, last, rd) || start_small(w->e, fetch, rd) ||
                  start_block(w->e, fetch, rd)))
        return 0;
    return queued(w, enqueue_read(w->e, rd));
}

/* Queue GETXATTR or LISTXATTR ``q`` for Python, as read_for_python does a READ. */
int xattr_for_python(struct fe_worker *w, struct fe_request *q)
{
    q->xattr.fd = python_fd(w);
    return queued(w, enqueue(w->e, q));
}

size_t fe_take(struct fe_engine *e, struct fe_request *out, size_t max)
{
    pthread_mutex_lock(&e->qlock);
    size_t n = e->qlen < max ? e->qlen : max;
    for (size_t i = 0; i < n; i++)
        out[i] = e->q[(e->qhead + i) % e->qcap];
    if (n) {
        e->qhead = (e->qhead + n) % e->qcap;
        e->qlen -= n;
    }
    pthread_mutex_unlock(&e->qlock);
    return n;
}
