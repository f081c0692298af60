/* fetch_read.c — one verified RDMA READ from a peer's arena (fetch_read.h). */
#include "fetch_read.h"

#include <string.h>

#include "fuse_xxh.h"

int fr_post_read(const struct ks_capi *api, ks_engine *ke, ks_cq *cq, uint32_t qpn,
                 uint64_t wr_id, void *laddr, uint32_t lkey, uint64_t raddr, uint32_t rkey,
                 uint32_t len, const char **why)
{
    ks_wqe w;
    memset(&w, 0, sizeof w);
    w.wr_id = wr_id;
    w.opcode = KS_WR_RDMA_READ;
    w.flags = KS_SEND_SIGNALED;
    w.nsge = 1;
    w.total = len;
    w.raddr = raddr;
    w.rkey = rkey;
    w.sge[0] = (ks_sge){.addr = (uint64_t)(uintptr_t)laddr, .length = len, .lkey = lkey};
    w.cq = cq;
    return api->post_send(ke, qpn, &w, 1, why);
}

int fr_verify(const ks_wc *wc, const uint8_t *laddr, uint32_t len, const uint8_t *want,
              size_t wantlen)
{
    if (wc->status != KS_WC_SUCCESS)
        return (int)wc->status;
    if (wc->byte_len != len)
        return FE_FETCH_SHORT;
    uint8_t d[16];
    if (wantlen == 8)
        fe_xxh64(laddr, len, d);
    else
        fe_xxh128(laddr, len, d);
    return memcmp(d, want, wantlen) == 0 ? FE_FETCH_OK : FE_FETCH_MISMATCH;
}
