/* fetch_read.h — one verified RDMA READ from a peer's arena: what the mount's native
 * fetch (fuse_fetch.c) and the library's waiting fetch (peer_wait.c) share. The post goes
 * on the caller's own CQ (a WR with its own CQ always completes: soft_engine.h
 * ks_post_send), and its WC and bytes are checked the same way for both: a WC error, a
 * short READ or a digest mismatch (the replica reused the slot) is a status, never an
 * error of the reader (docs/design.md, "The library's native fetch"). */
#ifndef KSPEEDFS_FETCH_READ_H
#define KSPEEDFS_FETCH_READ_H

#include <stddef.h>
#include <stdint.h>

#include "soft_engine.h"

/* A fetch's status beyond the WC's (ks_wc.status, < 64) */
enum {
    FE_FETCH_OK = 0,
    FE_FETCH_SHORT = 64,
    FE_FETCH_MISMATCH = 65,
    FE_FETCH_EXISTS = 66,
    FE_FETCH_STOPPED = 67,
    FE_FETCH_NOMEM = 68,
    FE_FETCH_LATE = 69
};

/* One signaled RDMA READ of ``len`` bytes at ``raddr``/``rkey`` into ``laddr``/``lkey`` on
 * QP ``qpn`` of ``ke``, its WC on ``cq`` under ``wr_id``; the post's error, or 0. */
int fr_post_read(const struct ks_capi *api, ks_engine *ke, ks_cq *cq, uint32_t qpn,
                 uint64_t wr_id, void *laddr, uint32_t lkey, uint64_t raddr, uint32_t rkey,
                 uint32_t len, const char **why);

/* The status of a READ of ``len`` bytes that landed at ``laddr`` with WC ``wc``, checked
 * against ``want``: xxh3-128 (``wantlen`` 16) or xxh3-64 (8: a block). */
int fr_verify(const ks_wc *wc, const uint8_t *laddr, uint32_t len, const uint8_t *want,
              size_t wantlen);

#endif
