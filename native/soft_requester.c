/* soft_requester.c — the requester side: SGE arithmetic, requests sent from the send
 * queue, and responses read straight into the WQEs' SGEs. */
#define _GNU_SOURCE
#include "soft_engine_i.h"

#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>

/* ------------------------------------------------------------------ SGE arithmetic */

/* Copy `len` bytes from `src` into the SGE list starting at byte `off` of the list. */
void sge_copy_in(const ks_sge *sge, uint32_t nsge, uint64_t off, const uint8_t *src,
                 uint64_t len)
{
    for (uint32_t i = 0; i < nsge && len; i++) {
        if (off >= sge[i].length) {
            off -= sge[i].length;
            continue;
        }
        uint64_t take = sge[i].length - off;
        if (take > len)
            take = len;
        memcpy((uint8_t *)(uintptr_t)sge[i].addr + off, src, take);
        src += take;
        len -= take;
        off = 0;
    }
}

/* iovecs covering SGE bytes [off, off+len); returns the count (<= max). */
static int sge_iov(const ks_sge *sge, uint32_t nsge, uint64_t off, uint64_t len,
                   struct iovec *iov, int max)
{
    int n = 0;
    for (uint32_t i = 0; i < nsge && len && n < max; i++) {
        if (off >= sge[i].length) {
            off -= sge[i].length;
            continue;
        }
        uint64_t take = sge[i].length - off;
        if (take > len)
            take = len;
        iov[n].iov_base = (uint8_t *)(uintptr_t)sge[i].addr + off;
        iov[n].iov_len = take;
        n++;
        len -= take;
        off = 0;
    }
    return n;
}

/* Local SGE check (lkey, PD, bounds, and LOCAL_WRITE when the HCA writes into it). */
int sge_ok(ks_engine *e, int pd, const ks_sge *s, int need_write)
{
    if (s->length == 0)
        return 1;
    ks_mr *mr = ks_mr_get(e, s->lkey);
    if (!mr || mr->pd != pd)
        return 0;
    if (need_write && !(mr->access & KS_ACCESS_LOCAL_WRITE))
        return 0;
    if (s->addr < mr->addr || s->addr - mr->addr > mr->length ||
        s->length > mr->length - (s->addr - mr->addr))
        return 0;
    return 1;
}

/* ------------------------------------------------------------------- requester side */

static uint64_t wqe_wire_len(const ks_wqe *w)
{
    return KS_HDR_LEN + (w->opcode == KS_WR_SEND ? w->total : 0);
}

/* Transmit queued requests.  0: done or would block; <0: -errno (connection broken). */
int req_tx(ks_engine *e, ks_qp *qp)
{
    ks_conn *c = qp->req;
    uint64_t budget = KS_TX_BUDGET;
    while (c && !c->dead && qp->sq_sent != qp->sq_tail && budget) {
        struct iovec iov[KS_IOV];
        int cnt = 0;
        uint64_t skip = c->tx_off;
        for (uint32_t n = qp->sq_sent; n != qp->sq_tail && cnt < KS_IOV - 1; n++) {
            ks_wqe *w = &qp->sq[n % qp->max_send_wr];
            if (skip < KS_HDR_LEN) {
                iov[cnt].iov_base = w->hdr + skip;
                iov[cnt].iov_len = KS_HDR_LEN - skip;
                cnt++;
                skip = 0;
            } else {
                skip -= KS_HDR_LEN;
            }
            if (w->opcode == KS_WR_SEND && w->total > skip)
                cnt += sge_iov(w->sge, w->nsge, skip, w->total - skip, iov + cnt,
                               KS_IOV - cnt);
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
        qp->last_progress = now_ns();
        e->n_tx_bytes += r;
        budget = (uint64_t)r >= budget ? 0 : budget - r;
        uint64_t done = c->tx_off + (uint64_t)r;
        while (qp->sq_sent != qp->sq_tail) {
            uint64_t wl = wqe_wire_len(&qp->sq[qp->sq_sent % qp->max_send_wr]);
            if (done < wl)
                break;
            done -= wl;
            qp->sq_sent++;
        }
        c->tx_off = done;
    }
    return 0;
}

static void req_complete_head(ks_qp *qp)
{
    send_wc(qp, &qp->sq[qp->sq_head % qp->max_send_wr], KS_WC_SUCCESS,
            (uint32_t)qp->sq[qp->sq_head % qp->max_send_wr].total);
    qp->sq_head++;
}

/* Process what is staged.  0: need more bytes; 1: the QP went to ERR (stop);
 * <0: protocol violation. */
static int req_consume(ks_engine *e, ks_qp *qp, ks_conn *c)
{
    for (;;) {
        if (!c->in_payload) {
            if (c->slen - c->spos < KS_HDR_LEN)
                return 0;
            struct ks_hdr h;
            int rc = ks_hdr_parse(c->stage + c->spos, &h, KS_ROLE_RESPONSES);
            if (rc < 0)
                return rc;
            c->spos += KS_HDR_LEN;
            if (qp->sq_head == qp->sq_sent)
                return -EPROTO; /* response to nothing */
            ks_wqe *w = &qp->sq[qp->sq_head % qp->max_send_wr];
            if (h.psn != w->psn)
                return -EPROTO; /* out of order */
            if ((w->opcode == KS_WR_RDMA_READ) != (h.opcode == KS_OP_READ_RESP))
                return -EPROTO;
            if (h.status != 0) {
                /* NAK: only the statuses a responder sends become our WC status */
                if (h.status != KS_WC_REM_INV_REQ_ERR && h.status != KS_WC_REM_ACCESS_ERR &&
                    h.status != KS_WC_REM_OP_ERR)
                    return -EPROTO;
                qp_fatal(e, qp, h.status);
                return 1;
            }
            if (h.opcode == KS_OP_READ_RESP && h.length != w->total)
                return -EPROTO;
            if (h.length == 0) {
                req_complete_head(qp);
                continue;
            }
            c->cur = h;
            c->in_payload = 1;
            c->pay_off = 0;
        }
        uint64_t avail = c->slen - c->spos;
        if (avail == 0)
            return 0;
        uint64_t need = c->cur.length - c->pay_off;
        uint64_t take = avail < need ? avail : need;
        ks_wqe *w = &qp->sq[qp->sq_head % qp->max_send_wr];
        sge_copy_in(w->sge, w->nsge, c->pay_off, c->stage + c->spos, take);
        c->spos += take;
        c->pay_off += take;
        if (c->pay_off == c->cur.length) {
            c->in_payload = 0;
            req_complete_head(qp);
        }
    }
}

void stage_compact(ks_conn *c)
{
    if (c->spos == 0)
        return;
    memmove(c->stage, c->stage + c->spos, c->slen - c->spos);
    c->slen -= c->spos;
    c->spos = 0;
}

static void req_set_lowat(ks_conn *c)
{
    /* payload that is certain to come (its length is known): wake once it is all here,
     * up to KS_LOWAT at a time.  Never above 1 while a header is due: a NAK is a bare
     * header and must wake us. */
    int want = 1;
    if (c->in_payload) {
        uint64_t left = c->cur.length - c->pay_off;
        if (left >= KS_LOWAT_MIN)
            want = left < KS_LOWAT ? (int)left : (int)KS_LOWAT;
    }
    if (want != c->lowat && !c->dead) {
        setsockopt(c->fd, SOL_SOCKET, SO_RCVLOWAT, &want, sizeof want);
        c->lowat = want;
    }
}

/* What was just read is ACKed now, and so is what comes next (TCP_QUICKACK lasts until
 * the connection looks interactive again: re-armed after every receive; design notes). */
void ack_now(ks_conn *c)
{
    int one = 1;
    if (!c->dead)
        setsockopt(c->fd, IPPROTO_TCP, TCP_QUICKACK, &one, sizeof one);
}

static int req_rx_loop(ks_engine *e, ks_qp *qp, ks_conn *c);

/* Read responses.  0: fine / would block; 1: QP went to ERR; <0: -errno. */
int req_rx(ks_engine *e, ks_qp *qp, ks_conn *c)
{
    int rc = req_rx_loop(e, qp, c);
    if (rc == 0 && !c->dead && qp->req == c) {
        req_set_lowat(c);
        ack_now(c);
    }
    return rc;
}

static int req_rx_loop(ks_engine *e, ks_qp *qp, ks_conn *c)
{
    uint64_t budget = KS_RX_BUDGET;
    for (;;) {
        int rc = req_consume(e, qp, c);
        if (rc != 0)
            return rc;
        if (c->dead || qp->req != c || !budget)
            return 0;
        ssize_t n;
        if (c->in_payload) {
            if (e->quiescing)
                return 0; /* a quiesce() waits: it goes first (level-triggered: the
                                 * bytes wait in the socket for the next epoll round) */
            /* the bulk: straight from the socket into registered memory */
            ks_wqe *w = &qp->sq[qp->sq_head % qp->max_send_wr];
            struct iovec iov[KS_MAX_SGE + 1];
            int cnt = sge_iov(w->sge, w->nsge, c->pay_off, c->cur.length - c->pay_off, iov,
                              KS_MAX_SGE);
            uint64_t asked = c->cur.length - c->pay_off;
            /* the next response's header rides along in the same readv (into the stage,
             * which req_consume has emptied): one syscall per READ, not two */
            stage_compact(c);
            uint32_t extra = c->slen < KS_HDR_LEN ? KS_HDR_LEN - c->slen : 0;
            if (extra) {
                iov[cnt].iov_base = c->stage + c->slen;
                iov[cnt].iov_len = extra;
                cnt++;
            }
            e->rx_busy = 1;
            signal_flush(e);
            pthread_mutex_unlock(&e->lock);
            n = readv(c->fd, iov, cnt);
            int saved = errno;
            pthread_mutex_lock(&e->lock);
            e->rx_busy = 0;
            pthread_cond_broadcast(&e->rx_cond);
            errno = saved;
            if (n > 0) {
                uint64_t pay = (uint64_t)n < asked ? (uint64_t)n : asked;
                c->pay_off += pay;
                c->slen += (uint32_t)((uint64_t)n - pay);
                if (c->pay_off == c->cur.length) {
                    c->in_payload = 0;
                    req_complete_head(qp);
                }
                if ((uint64_t)n < asked + extra) {
                    /* drained the socket: back to epoll (level-triggered) rather than
                     * a readv that would only say EAGAIN; a partial header waits staged */
                    qp->last_progress = qp->last_rx = now_ns();
                    e->n_rx_bytes += n;
                    return 0;
                }
            }
        } else {
            stage_compact(c);
            uint32_t want = KS_STAGE - c->slen;
            if (qp->sq_head != qp->sq_sent) {
                ks_wqe *w = &qp->sq[qp->sq_head % qp->max_send_wr];
                if (w->opcode == KS_WR_RDMA_READ && w->total > KS_SMALL)
                    want = KS_HDR_LEN - c->slen; /* header only; payload goes direct */
            }
            n = recv(c->fd, c->stage + c->slen, want, 0);
            if (n > 0)
                c->slen += n;
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
        qp->last_progress = qp->last_rx = now_ns();
        e->n_rx_bytes += n;
        budget = (uint64_t)n >= budget ? 0 : budget - n;
    }
}
