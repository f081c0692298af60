/* soft_mr.c — memory regions: registration, and deregistration that first kills every
 * connection and QP whose queued work still points into the MR. */
#define _GNU_SOURCE
#include "soft_engine_i.h"

#include <errno.h>
#include <stdlib.h>
#include <sys/random.h>

/* ---------------------------------------------------------------------------- MRs */

int ks_mr_new(int pd, uint64_t addr, uint64_t length, int access, ks_mr **out,
              const char **why)
{
    *why = NULL;
    if (addr + length < addr) {
        *why = "reg_mr: address range wraps";
        return -EINVAL;
    }
    ks_mr *mr = calloc(1, sizeof *mr);
    if (!mr)
        return -ENOMEM;
    uint32_t rnd;
    if (getrandom(&rnd, sizeof rnd, 0) != sizeof rnd)
        rnd = (uint32_t)now_ns();
    mr->key = rnd << 12;
    mr->pd = pd;
    mr->addr = addr;
    mr->length = length;
    mr->access = access;
    *out = mr;
    return 0;
}

uint32_t ks_mr_add(ks_engine *e, ks_mr *mr)
{
    for (uint32_t i = 1; i < KS_MAX_MR; i++) { /* slot 0 unused: key 0 is never valid */
        if (!e->mrs[i]) {
            mr->key |= i;
            e->mrs[i] = mr;
            return mr->key;
        }
    }
    return 0;
}

static int wqe_uses(const ks_sge *s, uint32_t n, uint32_t key)
{
    for (uint32_t i = 0; i < n; i++)
        if (s[i].lkey == key && s[i].length)
            return 1;
    return 0;
}

/* Does anything queued on `qp` still point into MR `key`? */
static int qp_uses_mr(const ks_qp *qp, uint32_t key)
{
    for (uint32_t n = qp->sq_head; n != qp->sq_tail; n++) {
        const ks_wqe *w = &qp->sq[n % qp->max_send_wr];
        if (wqe_uses(w->sge, w->nsge, key))
            return 1;
    }
    for (uint32_t n = qp->rq_head; n != qp->rq_tail; n++) {
        const ks_rwqe *r = &qp->rq[n % qp->max_recv_wr];
        if (wqe_uses(r->sge, r->nsge, key))
            return 1;
    }
    const ks_conn *c = qp->resp;
    for (uint32_t j = 0; c && j < c->jcount; j++)
        if (c->jobs[(c->jhead + j) % KS_RESP_JOBS].mr_key == key)
            return 1;
    return 0;
}

void ks_mr_dereg(ks_engine *e, ks_mr *mr)
{
    quiesce(e);
    e->mrs[mr->key & (KS_MAX_MR - 1)] = NULL;
    /* Nothing may touch this memory after we return: kill users of it. */
    for (uint32_t i = 0; i < e->qp_hi; i++) {
        ks_qp *qp = e->qps[i];
        if (!qp || !qp_uses_mr(qp, mr->key))
            continue;
        if (qp->state == KS_QPS_RESET || qp->state == KS_QPS_ERR) {
            conn_kill(e, qp->resp);
            conn_kill(e, qp->req);
        } else {
            qp_fatal(e, qp, KS_WC_WR_FLUSH_ERR);
        }
    }
}

void ks_mr_free(ks_mr *mr) { free(mr); }
