/* soft_cq.c — completions: a CQ's WC ring and its eventfd, the WCs of send WRs, and
 * the CQ API (moderation, polling). */
#define _GNU_SOURCE
#include "soft_engine_i.h"

#include <errno.h>
#include <stdlib.h>
#include <sys/eventfd.h>
#include <unistd.h>

/* ---------------------------------------------------------------------------- CQs */

static void cq_push(ks_cq *cq, const ks_wc *wc)
{
    pthread_mutex_lock(&cq->lock);
    if (cq->count == cq->cap) {
        /* CQ overrun on hardware; here we grow rather than lose a completion */
        uint32_t ncap = cq->cap * 2;
        ks_wc *n = malloc(sizeof(ks_wc) * ncap);
        if (!n) {
            pthread_mutex_unlock(&cq->lock);
            return;
        }
        for (uint32_t i = 0; i < cq->count; i++)
            n[i] = cq->ring[(cq->head + i) % cq->cap];
        free(cq->ring);
        cq->ring = n;
        cq->cap = ncap;
        cq->head = 0;
    }
    cq->ring[(cq->head + cq->count) % cq->cap] = *wc;
    cq->count++;
    int signal = 0;
    if (!cq->signaled) {
        if (cq->mod_count <= 1 || cq->count >= cq->mod_count) {
            signal = 1; /* written below, after cq->lock: see poll_cq */
            cq->signaled = 1;
        } else if (!cq->first_unsignaled) {
            cq->first_unsignaled = now_ns(); /* run_timers signals it after the period */
            if (!pthread_equal(pthread_self(), cq->engine_thread)) {
                /* an app thread pushed (a flush): the engine may be asleep */
                efd_post(cq->kickfd);
            }
        }
    }
    pthread_mutex_unlock(&cq->lock);
    if (signal) {
        /* outside cq->lock, so the poller this wakes does not sleep on it; the CQ cannot
         * go away meanwhile (callers hold e->lock, which destroy_cq takes).  On the
         * engine thread: just before it drops e->lock (signal_flush). */
        if (pthread_equal(pthread_self(), cq->engine_thread)) {
            ks_cq *prev = *cq->defer;
            *cq->defer = cq;
            if (!prev || prev == cq)
                return;
            cq = prev; /* one slot: the older CQ is woken now */
        }
        efd_post(cq->efd);
    }
}

/* The engine thread, holding e->lock, about to release it: deliver the deferred
 * wake-up (see ks_engine.defer_sig). */
void signal_flush(ks_engine *e)
{
    ks_cq *cq = e->defer_sig;
    if (cq) {
        e->defer_sig = NULL;
        efd_post(cq->efd);
    }
}

void push_wc(ks_cq *cq, uint64_t wr_id, uint32_t status, uint32_t opcode, uint32_t byte_len,
             uint32_t qpn)
{
    ks_wc wc = {.wr_id = wr_id,
                .status = status,
                .opcode = opcode,
                .byte_len = byte_len,
                .qp_num = qpn,
                .vendor_err = 0};
    cq_push(cq, &wc);
}

uint32_t wc_opcode_of(uint32_t wr_opcode)
{
    return wr_opcode == KS_WR_RDMA_READ ? KS_WC_RDMA_READ : KS_WC_SEND;
}

/* The WC of send WR `w`: on its own CQ (which it then stops using) or, if signalled, on
 * the QP's send CQ.  Caller holds e->lock. */
void send_wc(ks_qp *qp, ks_wqe *w, uint32_t status, uint32_t byte_len)
{
    if (w->cq) {
        ks_cq *cq = w->cq;
        w->cq = NULL;
        cq->refs--;
        push_wc(cq, w->wr_id, status, wc_opcode_of(w->opcode), byte_len, qp->qpn);
    } else if (status != KS_WC_SUCCESS || (w->flags & KS_SEND_SIGNALED) || qp->sig_all) {
        push_wc(qp->scq, w->wr_id, status, wc_opcode_of(w->opcode), byte_len, qp->qpn);
    }
}

/* Reset or destruction drops the send queue: WRs with their own CQ complete
 * WR_FLUSH_ERR there (ks_post_send); the binding's vanish, as on verbs. */
void sq_drop(ks_qp *qp)
{
    for (uint32_t n = qp->sq_head; n != qp->sq_tail; n++) {
        ks_wqe *w = &qp->sq[n % qp->max_send_wr];
        if (w->cq)
            send_wc(qp, w, KS_WC_WR_FLUSH_ERR, 0);
    }
    qp->sq_head = qp->sq_sent = qp->sq_tail = 0;
}

/* ------------------------------------------------------------------- the API: CQs */

int ks_cq_new(int cqe, ks_cq **out, const char **why)
{
    *why = NULL;
    ks_cq *cq = calloc(1, sizeof *cq);
    if (!cq)
        return -ENOMEM;
    cq->cap = cqe < 1 ? 1 : (uint32_t)cqe;
    cq->ring = malloc(sizeof(ks_wc) * cq->cap);
    cq->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (!cq->ring || cq->efd < 0) {
        int err = errno;
        free(cq->ring);
        if (cq->efd >= 0)
            close(cq->efd);
        free(cq);
        *why = "create_cq";
        return -(err ? err : ENOMEM);
    }
    mutex_init_adaptive(&cq->lock);
    *out = cq;
    return 0;
}

int ks_cq_add(ks_engine *e, ks_cq *cq)
{
    int id = -ENOMEM;
    pthread_mutex_lock(&e->cq_tab_lock);
    for (int i = 0; i < KS_MAX_CQ && id < 0; i++)
        if (!e->cqs[i])
            id = i;
    if (id >= 0) {
        cq->id = id;
        cq->kickfd = e->kickfd;
        cq->engine_thread = e->thread;
        cq->defer = &e->defer_sig;
        e->cqs[id] = cq;
    }
    pthread_mutex_unlock(&e->cq_tab_lock);
    return id;
}

int ks_cq_efd(const ks_cq *cq) { return cq->efd; }

ks_cq *ks_cq_get(ks_engine *e, int id) { return e->cqs[id]; }

int ks_cq_remove(ks_engine *e, ks_cq *cq, const char **why)
{
    if (cq->refs) {
        *why = "destroy_cq: QPs still use this CQ";
        return -EBUSY;
    }
    if (e->defer_sig == cq)
        e->defer_sig = NULL; /* nobody may wait on a CQ being destroyed */
    pthread_mutex_lock(&e->cq_tab_lock);
    e->cqs[cq->id] = NULL;
    pthread_mutex_unlock(&e->cq_tab_lock);
    return 0;
}

void ks_cq_free(ks_cq *cq)
{
    if (!cq)
        return;
    close(cq->efd);
    pthread_mutex_destroy(&cq->lock);
    free(cq->ring);
    free(cq);
}

/* Moderation and polling touch only the CQ table and the ring: they take e->cq_tab_lock
 * (so the CQ cannot be destroyed meanwhile) and cq->lock, never e->lock, so they never
 * wait for the engine's socket I/O. */
int ks_cq_moderate(ks_engine *e, int id, uint32_t count, uint32_t period_us, const char **why)
{
    if (count > 1 && period_us == 0) {
        *why = "modify_cq: cq_count > 1 needs a cq_period (or WCs could wait forever)";
        return -EINVAL;
    }
    int rc = 0;
    pthread_mutex_lock(&e->cq_tab_lock);
    ks_cq *cq = e->cqs[id];
    if (!cq) {
        rc = -EBADF;
        *why = "modify_cq: CQ destroyed";
    } else {
        pthread_mutex_lock(&cq->lock);
        cq->mod_count = count;
        cq->mod_period_ns = (uint64_t)period_us * 1000ull;
        if (!cq->signaled && cq->count) { /* signal what already waits */
            efd_post(cq->efd);
            cq->signaled = 1;
        }
        pthread_mutex_unlock(&cq->lock);
    }
    pthread_mutex_unlock(&e->cq_tab_lock);
    if (rc == 0)
        efd_post(e->kickfd); /* the engine plans its sleep around CQ periods too */
    return rc;
}

/* Take up to `num` WCs off the ring; re-arm the eventfd once it is empty. */
static int cq_take(ks_cq *cq, ks_wc *wc, int num)
{
    int got = 0, drain = 0;
    pthread_mutex_lock(&cq->lock);
    while (got < num && cq->count) {
        wc[got++] = cq->ring[cq->head];
        cq->head = (cq->head + 1) % cq->cap;
        cq->count--;
    }
    if (cq->count == 0) {
        cq->first_unsignaled = 0;
        drain = cq->signaled; /* only a signalled CQ has an eventfd count to drain */
    }
    pthread_mutex_unlock(&cq->lock);
    /* Re-arm: the fd is unreadable while the ring is empty.  The read happens outside
     * cq->lock (the engine pushing the next WC must not wait on our syscall).  cq_push
     * writes the eventfd after dropping cq->lock (engine thread: just before it drops
     * e->lock): if that write has not landed yet (EAGAIN) the CQ stays `signaled` and a
     * later poll drains it.  If WCs arrived while we read, they found `signaled` set and
     * did not write: write for them. */
    uint64_t v;
    if (drain && read(cq->efd, &v, sizeof v) == (ssize_t)sizeof v) {
        pthread_mutex_lock(&cq->lock);
        int again = cq->count != 0;
        if (!again)
            cq->signaled = 0;
        pthread_mutex_unlock(&cq->lock);
        if (again)
            efd_post(cq->efd);
    }
    return got;
}

int ks_cq_poll(ks_engine *e, int id, ks_wc *wc, int num, const char **why)
{
    int rc;
    pthread_mutex_lock(&e->cq_tab_lock);
    ks_cq *cq = e->cqs[id];
    if (!cq) {
        rc = -EBADF;
        *why = "poll_cq: CQ destroyed";
    } else {
        rc = cq_take(cq, wc, num);
    }
    pthread_mutex_unlock(&e->cq_tab_lock);
    return rc;
}
