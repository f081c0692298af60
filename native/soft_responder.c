/* soft_responder.c — the responder side: requests read and checked (rkey, PD, bounds,
 * access), READ responses sent from MR memory, SENDs delivered to receive WRs. */
#define _GNU_SOURCE
#include "soft_engine_i.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>

/* ------------------------------------------------------------------- responder side */

int resp_rx_enabled(ks_conn *c)
{
    ks_qp *qp = c->qp;
    if (!qp || c->dead || c->fatal_after || qp->resp != c)
        return 0; /* (a candidate is read only once chosen) */
    if (qp->state != KS_QPS_RTR && qp->state != KS_QPS_RTS)
        return 0;
    if (c->jcount >= KS_RESP_JOBS)
        return 0;
    if (qp->pend_bytes >= KS_MAX_PENDING)
        return 0;
    return 1;
}

static void job_push(ks_conn *c, uint8_t op, uint32_t psn, uint32_t status,
                     const uint8_t *data, uint64_t len, uint32_t mr_key)
{
    ks_job *j = &c->jobs[(c->jhead + c->jcount) % KS_RESP_JOBS];
    struct ks_hdr h = {.opcode = op, .status = status, .psn = psn, .length = (uint32_t)len};
    ks_hdr_build(j->hdr, &h);
    j->data = data;
    j->len = len;
    j->mr_key = mr_key;
    c->jcount++;
}

/* Check a READ request against the responder QP and the MR table. */
static uint32_t read_check(ks_engine *e, ks_qp *qp, const struct ks_hdr *h,
                           const uint8_t **data)
{
    *data = NULL;
    if (!(qp->access & KS_ACCESS_REMOTE_READ))
        return KS_WC_REM_INV_REQ_ERR; /* QP does not allow READ: invalid request */
    if (h->rlen == 0)
        return KS_WC_SUCCESS; /* zero-length READ checks no key (IB) */
    ks_mr *mr = ks_mr_get(e, h->rkey);
    if (!mr || mr->pd != qp->pd || !(mr->access & KS_ACCESS_REMOTE_READ))
        return KS_WC_REM_ACCESS_ERR;
    if (h->raddr < mr->addr || h->raddr - mr->addr > mr->length ||
        (uint64_t)h->rlen > mr->length - (h->raddr - mr->addr))
        return KS_WC_REM_ACCESS_ERR;
    *data = (const uint8_t *)(uintptr_t)h->raddr;
    return KS_WC_SUCCESS;
}

/* Deliver buffered SENDs to posted RECVs (in order). */
void deliver_pending(ks_engine *e, ks_qp *qp)
{
    while (qp->pend_head && qp->rq_head != qp->rq_tail && qp->state != KS_QPS_ERR) {
        ks_pending *p = qp->pend_head;
        ks_rwqe *r = &qp->rq[qp->rq_head % qp->max_recv_wr];
        if (p->len > r->total) {
            /* RECV too small: local length error, the QP goes to ERR */
            qp->rq_head++;
            push_wc(qp->rcq, r->wr_id, KS_WC_LOC_LEN_ERR, KS_WC_RECV, p->len, qp->qpn);
            qp_fatal_at(e, qp, qp->sq_tail, KS_WC_WR_FLUSH_ERR);
            return;
        }
        sge_copy_in(r->sge, r->nsge, 0, p->data, p->len);
        qp->rq_head++;
        push_wc(qp->rcq, r->wr_id, KS_WC_SUCCESS, KS_WC_RECV, p->len, qp->qpn);
        qp->pend_head = p->next;
        if (!qp->pend_head)
            qp->pend_tail = NULL;
        qp->pend_bytes -= p->len;
        free(p);
    }
}

/* A complete SEND arrived (owned buffer `buf`). */
static int send_arrived(ks_engine *e, ks_qp *qp, ks_conn *c, uint8_t *buf, uint32_t len,
                        uint32_t psn)
{
    if (!qp->pend_head && qp->rq_head != qp->rq_tail &&
        len > qp->rq[qp->rq_head % qp->max_recv_wr].total) {
        /* posted RECV too small: LOC_LEN_ERR here, REM_INV_REQ_ERR at the requester,
         * then this QP goes to ERR once the NAK is out (IB class C) */
        ks_rwqe *r = &qp->rq[qp->rq_head % qp->max_recv_wr];
        qp->rq_head++;
        push_wc(qp->rcq, r->wr_id, KS_WC_LOC_LEN_ERR, KS_WC_RECV, len, qp->qpn);
        job_push(c, KS_OP_SEND_ACK, psn, KS_WC_REM_INV_REQ_ERR, NULL, 0, 0);
        c->fatal_after = 1;
        return 0;
    }
    ks_pending *p = malloc(sizeof *p + len);
    if (!p)
        return -ENOMEM;
    p->next = NULL;
    p->len = len;
    if (len)
        memcpy(p->data, buf, len);
    if (qp->pend_tail)
        qp->pend_tail->next = p;
    else
        qp->pend_head = p;
    qp->pend_tail = p;
    qp->pend_bytes += len;
    job_push(c, KS_OP_SEND_ACK, psn, 0, NULL, 0, 0);
    deliver_pending(e, qp);
    return 0;
}

/* 0: need bytes / paused; 1: QP went to ERR; <0 protocol error. */
int resp_consume(ks_engine *e, ks_qp *qp, ks_conn *c)
{
    for (;;) {
        if (c->dead || qp->resp != c)
            return 1;
        if (c->in_payload) {
            uint64_t avail = c->slen - c->spos;
            uint64_t need = c->cur.length - c->pay_off;
            uint64_t take = avail < need ? avail : need;
            memcpy(c->sendbuf + c->pay_off, c->stage + c->spos, take);
            c->spos += take;
            c->pay_off += take;
            if (c->pay_off < c->cur.length)
                return 0;
            c->in_payload = 0;
            int rc = send_arrived(e, qp, c, c->sendbuf, c->cur.length, c->cur.psn);
            free(c->sendbuf);
            c->sendbuf = NULL;
            if (rc < 0)
                return rc;
            if (qp->state == KS_QPS_ERR)
                return 1;
            continue;
        }
        if (!resp_rx_enabled(c))
            return 0;
        if (c->slen - c->spos < KS_HDR_LEN)
            return 0;
        struct ks_hdr h;
        int rc = ks_hdr_parse(c->stage + c->spos, &h, KS_ROLE_REQUESTS);
        if (rc < 0)
            return rc;
        if (h.psn != qp->rq_psn)
            return -EPROTO; /* out of order / replayed */
        c->spos += KS_HDR_LEN;
        qp->rq_psn = (qp->rq_psn + 1) & 0xFFFFFF;
        if (h.opcode == KS_OP_READ_REQ) {
            const uint8_t *data;
            uint32_t st = read_check(e, qp, &h, &data);
            if (st == KS_WC_SUCCESS) {
                job_push(c, KS_OP_READ_RESP, h.psn, 0, data, h.rlen, h.rlen ? h.rkey : 0);
            } else {
                job_push(c, KS_OP_READ_RESP, h.psn, st, NULL, 0, 0);
                c->fatal_after = 1; /* NAK, then this QP goes to ERR (IB class C) */
                return 0;
            }
        } else { /* SEND */
            c->sendbuf = malloc(h.length ? h.length : 1);
            if (!c->sendbuf)
                return -ENOMEM;
            c->cur = h;
            c->in_payload = 1;
            c->pay_off = 0;
        }
    }
}

static int resp_rx_loop(ks_engine *e, ks_qp *qp, ks_conn *c);

/* Read requests (and SENDs).  0: fine / would block; 1: QP went to ERR; <0: -errno or a
 * protocol error. */
int resp_rx(ks_engine *e, ks_qp *qp, ks_conn *c)
{
    int rc = resp_rx_loop(e, qp, c);
    ack_now(c);
    return rc;
}

static int resp_rx_loop(ks_engine *e, ks_qp *qp, ks_conn *c)
{
    uint64_t budget = KS_RX_BUDGET;
    int drained = 0;
    for (;;) {
        int rc = resp_consume(e, qp, c);
        if (rc != 0)
            return rc;
        /* a short read emptied the socket: epoll (level-triggered) says when more comes,
         * no recv just to hear EAGAIN */
        if (c->dead || !budget || drained)
            return 0;
        if (!c->in_payload && !resp_rx_enabled(c))
            return 0;
        ssize_t n;
        if (c->in_payload && c->spos == c->slen) {
            uint64_t want = c->cur.length - c->pay_off;
            n = recv(c->fd, c->sendbuf + c->pay_off, want, 0);
            if (n > 0) {
                c->pay_off += n;
                drained = (uint64_t)n < want;
            }
            /* a complete payload: resp_consume finishes it (nothing staged) */
        } else {
            stage_compact(c);
            if (c->slen == KS_STAGE)
                return 0;
            uint32_t want = KS_STAGE - c->slen;
            n = recv(c->fd, c->stage + c->slen, want, 0);
            if (n > 0) {
                c->slen += n;
                drained = (uint32_t)n < want;
            }
        }
        if (n == 0)
            return -ECONNRESET;
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                return 0;
            return -errno;
        }
        e->n_rx_bytes += n;
        budget = (uint64_t)n >= budget ? 0 : budget - n;
    }
}

/* Send queued responses.  0 ok/would block; 1: drained a NAK, caller moves QP to ERR;
 * <0 -errno. */
int resp_tx(ks_engine *e, ks_conn *c)
{
    uint64_t budget = KS_TX_BUDGET;
    while (c->jcount && budget) {
        struct iovec iov[KS_IOV];
        int cnt = 0;
        uint64_t skip = c->tx_off;
        for (uint32_t i = 0; i < c->jcount && cnt < KS_IOV - 1; i++) {
            ks_job *j = &c->jobs[(c->jhead + i) % KS_RESP_JOBS];
            if (skip < KS_HDR_LEN) {
                iov[cnt].iov_base = j->hdr + skip;
                iov[cnt].iov_len = KS_HDR_LEN - skip;
                cnt++;
                skip = 0;
            } else {
                skip -= KS_HDR_LEN;
            }
            if (j->len > skip) {
                iov[cnt].iov_base = (void *)(j->data + skip);
                iov[cnt].iov_len = j->len - skip;
                cnt++;
            }
            skip = 0;
        }
        struct msghdr mh = {.msg_iov = iov, .msg_iovlen = cnt};
        ssize_t r = sendmsg(c->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                return 0;
            return -errno;
        }
        e->n_tx_bytes += r;
        budget = (uint64_t)r >= budget ? 0 : budget - r;
        uint64_t asked = 0;
        for (int i = 0; i < cnt; i++)
            asked += iov[i].iov_len;
        if ((uint64_t)r < asked)
            budget = 0; /* send buffer full: wait for EPOLLOUT, not for EAGAIN */
        uint64_t done = c->tx_off + (uint64_t)r;
        while (c->jcount) {
            ks_job *j = &c->jobs[c->jhead];
            if (done < KS_HDR_LEN + j->len)
                break;
            done -= KS_HDR_LEN + j->len;
            c->jhead = (c->jhead + 1) % KS_RESP_JOBS;
            c->jcount--;
        }
        c->tx_off = done;
    }
    if (c->fatal_after && c->jcount == 0)
        return 1;
    return 0;
}
