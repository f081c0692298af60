/* soft_qp.c — the QP machinery: the QPN table, QP state and its errors (RESET, INIT,
 * RTR, RTS, ERR), the QP API, and posting WRs to the send and receive queues. */
#define _GNU_SOURCE
#include "soft_engine_i.h"

#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>

/* -------------------------------------------------------------------------- tables */

/* QPNs are random, so the table is keyed by QPN (linear probing, at most half full:
 * KS_MAX_QP live QPs in 2 * KS_MAX_QP entries, so a probe always ends on an empty one). */
static uint32_t qpn_home(uint32_t qpn) { return (qpn * 2654435761u) % KS_QPN_TAB; }

ks_qp *ks_qp_get(ks_engine *e, uint32_t qpn)
{
    for (uint32_t i = qpn_home(qpn);; i = (i + 1) % KS_QPN_TAB) {
        ks_qp *qp = e->qpn_tab[i];
        if (!qp || qp->qpn == qpn)
            return qp;
    }
}

static void qpn_insert(ks_engine *e, ks_qp *qp)
{
    uint32_t i = qpn_home(qp->qpn);
    while (e->qpn_tab[i])
        i = (i + 1) % KS_QPN_TAB;
    e->qpn_tab[i] = qp;
}

/* Backward-shift deletion (no tombstones): entries after the hole whose home is not
 * cyclically in (hole, entry] move into the hole. */
static void qpn_remove(ks_engine *e, ks_qp *qp)
{
    uint32_t i = qpn_home(qp->qpn);
    while (e->qpn_tab[i] != qp)
        i = (i + 1) % KS_QPN_TAB;
    e->qpn_tab[i] = NULL;
    for (uint32_t j = (i + 1) % KS_QPN_TAB; e->qpn_tab[j]; j = (j + 1) % KS_QPN_TAB) {
        uint32_t k = qpn_home(e->qpn_tab[j]->qpn);
        int stays = i <= j ? (i < k && k <= j) : (i < k || k <= j);
        if (!stays) {
            e->qpn_tab[i] = e->qpn_tab[j];
            e->qpn_tab[j] = NULL;
            i = j;
        }
    }
}

ks_mr *ks_mr_get(ks_engine *e, uint32_t key)
{
    ks_mr *mr = e->mrs[key & (KS_MAX_MR - 1)];
    return (mr && mr->key == key) ? mr : NULL;
}

/* ------------------------------------------------------------------- QP state/errors */

/* Close every connection of the QP: both directions and the candidates. */
static void qp_kill_conns(ks_engine *e, ks_qp *qp)
{
    conn_kill(e, qp->req);
    conn_kill(e, qp->resp);
    while (qp->ncand)
        conn_kill(e, qp->cand[0]);
}

static void pending_free(ks_qp *qp)
{
    ks_pending *p = qp->pend_head;
    while (p) {
        ks_pending *n = p->next;
        free(p);
        p = n;
    }
    qp->pend_head = qp->pend_tail = NULL;
    qp->pend_bytes = 0;
}

/* QP -> ERR: kill both connections; the send WR at `culprit` (an SQ counter, or
 * qp->sq_tail for "none") completes with `status` first, every other outstanding send
 * and receive WR completes WR_FLUSH_ERR.  No-op in RESET or ERR. */
void qp_fatal_at(ks_engine *e, ks_qp *qp, uint32_t culprit, uint32_t status)
{
    quiesce(e);
    if (qp->state == KS_QPS_ERR || qp->state == KS_QPS_RESET)
        return;
    qp->state = KS_QPS_ERR;
    qp_kill_conns(e, qp);
    if (culprit != qp->sq_tail && status != KS_WC_WR_FLUSH_ERR)
        send_wc(qp, &qp->sq[culprit % qp->max_send_wr], status, 0);
    for (uint32_t n = qp->sq_head; n != qp->sq_tail; n++) {
        if (n == culprit && status != KS_WC_WR_FLUSH_ERR)
            continue;
        send_wc(qp, &qp->sq[n % qp->max_send_wr], KS_WC_WR_FLUSH_ERR, 0);
    }
    qp->sq_head = qp->sq_sent = qp->sq_tail;
    for (uint32_t n = qp->rq_head; n != qp->rq_tail; n++) {
        ks_rwqe *r = &qp->rq[n % qp->max_recv_wr];
        push_wc(qp->rcq, r->wr_id, KS_WC_WR_FLUSH_ERR, KS_WC_RECV, 0, qp->qpn);
    }
    qp->rq_head = qp->rq_tail;
    pending_free(qp);
}

/* The oldest outstanding send WR takes `status`. */
void qp_fatal(ks_engine *e, ks_qp *qp, uint32_t status)
{
    quiesce(e); /* before reading sq_head: the engine may be completing it */
    qp_fatal_at(e, qp, qp->sq_head, status);
}

void ks_qp_to_reset(ks_engine *e, ks_qp *qp)
{
    quiesce(e);
    qp_kill_conns(e, qp);
    sq_drop(qp);
    qp->rq_head = qp->rq_tail = 0;
    pending_free(qp);
    qp->pdata_len = -1;
    qp->dest_qpn = 0;
    qp->resp_src_qpn = 0;
    qp->peer_ip = 0;
    qp->expect = 0;
    qp->state = KS_QPS_RESET;
}

/* ---------------------------------------------------------------------------- QPs */

int ks_qp_new(const struct ks_qp_attr *a, ks_qp **out, const char **why)
{
    *why = NULL;
    if (a->max_send_wr < 1 || a->max_send_wr > KS_MAX_WR || a->max_recv_wr < 1 ||
        a->max_recv_wr > KS_MAX_WR || a->max_send_sge < 1 || a->max_send_sge > KS_MAX_SGE ||
        a->max_recv_sge < 1 || a->max_recv_sge > KS_MAX_SGE) {
        *why = "create_qp: capabilities out of range";
        return -EINVAL;
    }
    if (a->scq < 0 || a->scq >= KS_MAX_CQ || a->rcq < 0 || a->rcq >= KS_MAX_CQ) {
        *why = "create_qp: bad CQ";
        return -EINVAL;
    }
    ks_qp *qp = calloc(1, sizeof *qp);
    if (!qp)
        return -ENOMEM;
    qp->sq = calloc(a->max_send_wr, sizeof(ks_wqe));
    qp->rq = calloc(a->max_recv_wr, sizeof(ks_rwqe));
    if (!qp->sq || !qp->rq) {
        ks_qp_free(qp);
        return -ENOMEM;
    }
    qp->pd = a->pd;
    qp->sig_all = a->sig_all;
    qp->max_send_wr = a->max_send_wr;
    qp->max_recv_wr = a->max_recv_wr;
    qp->max_send_sge = a->max_send_sge;
    qp->max_recv_sge = a->max_recv_sge;
    qp->pdata_len = -1;
    qp->state = KS_QPS_RESET;
    /* QPN candidates drawn before the caller takes e->lock (getrandom may block early at
     * boot); ks_qp_add picks the first that is not 0/1 (SMI/GSI) nor a live QPN. */
    if (getrandom(qp->qpn_draws, sizeof qp->qpn_draws, 0) != (ssize_t)sizeof qp->qpn_draws) {
        int err = errno;
        ks_qp_free(qp);
        *why = "create_qp: getrandom";
        return -err;
    }
    *out = qp;
    return 0;
}

int ks_qp_add(ks_engine *e, ks_qp *qp, const struct ks_qp_attr *a, const char **why)
{
    qp->scq = e->cqs[a->scq];
    qp->rcq = e->cqs[a->rcq];
    int slot = -1;
    for (int i = 0; i < KS_MAX_QP && slot < 0; i++)
        if (!e->qps[i])
            slot = i;
    for (int i = 0; i < 8 && !qp->qpn; i++) {
        uint32_t qpn = qp->qpn_draws[i] & 0xFFFFFF;
        if (qpn > 1 && !ks_qp_get(e, qpn))
            qp->qpn = qpn;
    }
    *why = "create_qp";
    if (!qp->scq || !qp->rcq)
        return -EINVAL;
    if (slot < 0)
        return -ENOMEM;
    if (!qp->qpn)
        return -EAGAIN; /* 8 draws all taken, p < (4096 / 2^24)^8: never */
    qp->slot = (uint32_t)slot;
    qp->scq->refs++;
    qp->rcq->refs++;
    e->qps[slot] = qp;
    qpn_insert(e, qp);
    if ((uint32_t)slot + 1 > e->qp_hi)
        e->qp_hi = slot + 1;
    return (int)qp->qpn;
}

void ks_qp_remove(ks_engine *e, ks_qp *qp)
{
    quiesce(e);
    qp_kill_conns(e, qp);
    sq_drop(qp);
    e->qps[qp->slot] = NULL;
    qpn_remove(e, qp);
    qp->scq->refs--;
    qp->rcq->refs--;
}

void ks_qp_free(ks_qp *qp)
{
    if (!qp)
        return;
    pending_free(qp);
    free(qp->sq);
    free(qp->rq);
    free(qp);
}

int ks_qp_state(const ks_qp *qp) { return qp->state; }

int64_t ks_qp_rx_age(const ks_qp *qp)
{
    return qp->last_rx ? (int64_t)(now_ns() - qp->last_rx) : -1;
}

int ks_qp_private_data(const ks_qp *qp, uint8_t *buf)
{
    int n = qp->pdata_len;
    const uint8_t *src = qp->pdata;
    if (n < 0 && qp->ncand) { /* before RTR: the oldest candidate's (see expect_peer) */
        n = qp->cand[0]->pdata_len;
        src = qp->cand[0]->pdata;
    }
    if (n > 0)
        memcpy(buf, src, n);
    return n;
}

void ks_qp_init(ks_qp *qp, int access)
{
    qp->access = access;
    if (qp->state == KS_QPS_RESET)
        qp->state = KS_QPS_INIT;
}

void ks_qp_set_access(ks_qp *qp, int access) { qp->access = access; }

int ks_qp_to_rtr(ks_engine *e, ks_qp *qp, int fd, uint32_t dest_qpn, uint32_t rq_psn,
                 const char **why)
{
    if (qp->state != KS_QPS_INIT) {
        *why = "qp_rtr: QP not in INIT";
        return -EINVAL;
    }
    /* the peer device's address: its HELLO to us must come from there too (its
     * engine.connect binds the device address, and we connected to that device) */
    struct sockaddr_in pa;
    socklen_t pl = sizeof pa;
    if (getpeername(fd, (struct sockaddr *)&pa, &pl) < 0 || pa.sin_family != AF_INET) {
        *why = "qp_rtr: fd is not a connected IPv4 socket";
        return -EINVAL;
    }
    int fl = fcntl(fd, F_GETFL);
    fcntl(fd, F_SETFL, fl | O_NONBLOCK);
    ks_conn *c = conn_new(e, fd, CONN_REQ);
    if (!c) {
        *why = "qp_rtr: connection";
        return -ENOMEM;
    }
    c->qp = qp;
    qp->req = c;
    qp->dest_qpn = dest_qpn;
    qp->peer_ip = pa.sin_addr.s_addr;
    qp->rq_psn = rq_psn & 0xFFFFFF;
    qp->state = KS_QPS_RTR;
    /* keep the candidate that is our peer (the oldest, should there be two), close the
     * others: connections that raced our peer onto this QP */
    ks_conn *peer = NULL;
    for (int i = 0; i < qp->ncand; i++)
        if (!peer && hello_is_peer(qp, qp->cand[i]))
            peer = qp->cand[i];
    for (int i = qp->ncand - 1; i >= 0; i--)
        if (qp->cand[i] != peer)
            conn_kill(e, qp->cand[i]);
    if (peer && conn_attach(e, qp, peer) < 0)
        conn_kill(e, peer); /* ENOMEM: the peer sees EOF, its QP goes to ERR */
    return 0;
}

int ks_qp_expect(ks_engine *e, ks_qp *qp, uint32_t src_qpn, uint32_t ip, const uint8_t *pdata,
                 int pdata_len, const char **why)
{
    if (pdata_len > KS_MAX_PDATA || src_qpn > 0xFFFFFF) {
        *why = "qp_expect: QPN over 24 bits or private data over 256 B";
        return -EINVAL;
    }
    if (qp->state != KS_QPS_RESET && qp->state != KS_QPS_INIT) {
        *why = "qp_expect: QP not in RESET/INIT";
        return -EINVAL;
    }
    qp->expect = 1;
    qp->expect_qpn = src_qpn;
    qp->expect_ip = ip;
    qp->expect_pdata_len = pdata_len;
    if (pdata_len > 0)
        memcpy(qp->expect_pdata, pdata, pdata_len);
    for (int i = qp->ncand - 1; i >= 0; i--)
        if (!hello_is_peer(qp, qp->cand[i]))
            conn_kill(e, qp->cand[i]);
    return 0;
}

int ks_qp_to_rts(ks_qp *qp, uint32_t sq_psn, uint64_t timeout_ns, int set_psn,
                 const char **why)
{
    if (qp->state != KS_QPS_RTR && qp->state != KS_QPS_RTS) {
        *why = "qp_rts: QP not in RTR/RTS";
        return -EINVAL;
    }
    if (set_psn)
        qp->sq_psn = sq_psn & 0xFFFFFF;
    qp->timeout_ns = timeout_ns;
    qp->state = KS_QPS_RTS;
    return 0;
}

void ks_qp_to_err(ks_engine *e, ks_qp *qp)
{
    if (qp->state == KS_QPS_RESET)
        qp->state = KS_QPS_ERR;
    else
        qp_fatal_at(e, qp, qp->sq_tail, KS_WC_WR_FLUSH_ERR);
}

/* --------------------------------------------------------------------- posting WRs */

/* Append checked WRs to the send queue; send them now (an idle QP) or ask for the
 * doorbell (ks_post_send rings it).  A WR whose SGEs fail the local check completes
 * LOC_PROT_ERR and moves the QP to ERR (failed WRs are WCs, not errors of the post). */
static void sq_append(ks_engine *e, ks_qp *qp, const ks_wqe *wrs, size_t n)
{
    int was_idle = qp->sq_head == qp->sq_tail;
    uint64_t reads = 0; /* response bytes the batch asks for */
    size_t i = 0;
    for (; i < n && qp->state == KS_QPS_RTS; i++) {
        ks_wqe *w = &qp->sq[qp->sq_tail % qp->max_send_wr];
        *w = wrs[i];
        if (w->cq)
            w->cq->refs++;
        w->psn = qp->sq_psn;
        qp->sq_psn = (qp->sq_psn + 1) & 0xFFFFFF;
        struct ks_hdr h = {.psn = w->psn};
        if (w->opcode == KS_WR_RDMA_READ) {
            h.opcode = KS_OP_READ_REQ;
            h.rkey = w->rkey;
            h.rlen = (uint32_t)w->total;
            h.raddr = w->raddr;
            reads += w->total;
        } else {
            h.opcode = KS_OP_SEND;
            h.length = (uint32_t)w->total;
        }
        ks_hdr_build(w->hdr, &h);
        uint32_t at = qp->sq_tail++;
        int ok = 1;
        for (uint32_t s = 0; s < w->nsge && ok; s++)
            ok = sge_ok(e, qp->pd, &w->sge[s], w->opcode == KS_WR_RDMA_READ);
        if (!ok)
            qp_fatal_at(e, qp, at, KS_WC_LOC_PROT_ERR);
    }
    for (; i < n; i++) /* after a WR that sent the QP to ERR: never queued */
        if (wrs[i].cq)
            push_wc(wrs[i].cq, wrs[i].wr_id, KS_WC_WR_FLUSH_ERR, wc_opcode_of(wrs[i].opcode),
                    0, qp->qpn);
    if (qp->state != KS_QPS_RTS)
        return;
    if (was_idle)
        qp->last_progress = now_ns();
    if (was_idle && reads < KS_DOORBELL_READ)
        req_send(e, qp);
    else if (qp->req && !qp->req->dead) {
        e->doorbell = 1; /* the engine thread sends: doorbell_answer */
        e->n_doorbell_posts++;
    }
}

int ks_post_send(ks_engine *e, uint32_t qpn, const ks_wqe *wrs, size_t n, const char **why)
{
    int rc = 0;
    pthread_mutex_lock(&e->lock);
    ks_qp *qp = ks_qp_get(e, qpn);
    if (!qp) {
        rc = -EINVAL;
        *why = "post_send: unknown QP";
    } else if (qp->state != KS_QPS_RTS) {
        rc = -EINVAL;
        *why = "post_send: QP is not in RTS";
    } else if ((uint64_t)(qp->sq_tail - qp->sq_head) + (uint64_t)n > qp->max_send_wr) {
        rc = -ENOMEM;
        *why = "post_send: send queue full";
    } else {
        for (size_t i = 0; i < n && !rc; i++)
            if (wrs[i].nsge > qp->max_send_sge) {
                rc = -EINVAL;
                *why = "post_send: more SGEs than max_send_sge";
            } else if (wrs[i].cq && e->cqs[wrs[i].cq->id] != wrs[i].cq) {
                rc = -EINVAL;
                *why = "post_send: a WR's own CQ is not this engine's";
            }
    }
    int ring = 0;
    if (!rc) {
        int rung = e->doorbell;
        sq_append(e, qp, wrs, n);
        ring = e->doorbell && !rung;
    }
    pthread_mutex_unlock(&e->lock);
    if (ring)
        efd_post(e->kickfd);
    return rc;
}

/* Receive WRs were posted: buffered SENDs go to them, and the responder, paused while
 * its SENDs had nowhere to go, reads and answers again. */
static void resp_resume(ks_engine *e, ks_qp *qp)
{
    deliver_pending(e, qp);
    ks_conn *r = qp->resp;
    if (!r || r->dead)
        return;
    if (resp_rx_enabled(r) && r->slen > r->spos) {
        int rc = resp_consume(e, qp, r);
        if (rc < 0)
            conn_drop(e, r, rc, KS_WC_RETRY_EXC_ERR);
    }
    if (!r->dead && r->jcount)
        resp_flush(e, qp, r);
    if (qp->resp == r && !r->dead)
        conn_update_events(e, r);
}

/* Which receive WR fails the checks, if any: 0 or -EINVAL with *why. */
static int rq_check(ks_engine *e, const ks_qp *qp, const ks_rwqe *wrs, size_t n,
                    const char **why)
{
    for (size_t i = 0; i < n; i++) {
        if (wrs[i].nsge > qp->max_recv_sge) {
            *why = "post_recv: more SGEs than max_recv_sge";
            return -EINVAL;
        }
        for (uint32_t s = 0; s < wrs[i].nsge; s++)
            if (!sge_ok(e, qp->pd, &wrs[i].sge[s], 1)) {
                *why = "post_recv: SGE outside a local MR with LOCAL_WRITE";
                return -EINVAL;
            }
    }
    return 0;
}

int ks_post_recv(ks_engine *e, uint32_t qpn, const ks_rwqe *wrs, size_t n, const char **why)
{
    int rc = 0;
    pthread_mutex_lock(&e->lock);
    ks_qp *qp = ks_qp_get(e, qpn);
    if (!qp) {
        rc = -EINVAL;
        *why = "post_recv: unknown QP";
    } else if (qp->state == KS_QPS_RESET) {
        rc = -EINVAL;
        *why = "post_recv: QP is in RESET";
    } else if ((uint64_t)(qp->rq_tail - qp->rq_head) + (uint64_t)n > qp->max_recv_wr) {
        rc = -ENOMEM;
        *why = "post_recv: receive queue full";
    } else {
        rc = rq_check(e, qp, wrs, n, why);
    }
    for (size_t i = 0; i < n && !rc; i++) {
        if (qp->state == KS_QPS_ERR)
            push_wc(qp->rcq, wrs[i].wr_id, KS_WC_WR_FLUSH_ERR, KS_WC_RECV, 0, qp->qpn);
        else
            qp->rq[qp->rq_tail++ % qp->max_recv_wr] = wrs[i];
    }
    if (!rc)
        resp_resume(e, qp);
    pthread_mutex_unlock(&e->lock);
    return rc;
}
