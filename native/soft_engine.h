/* soft_engine.h — the soft RDMA provider's native engine: wire format and objects.
 *
 * Why native: a one-sided READ must be served without the application (no GIL, not on the
 * app's trio loop), and the payload must move socket <-> registered memory with no copy.
 * Python only creates objects, posts WRs and polls WCs; everything here runs GIL-free.
 *
 * Wire format (all little-endian, fixed 32-byte header, then `length` payload bytes):
 *
 *   off size field    meaning
 *   0   4    magic    KS_MAGIC "KSRD"
 *   4   1    version  KS_VERSION
 *   5   1    opcode   KS_OP_*
 *   6   1    status   responses: 0 ok, else the ibv_wc_status the requester completes with
 *   7   1    flags    must be 0
 *   8   4    psn      24-bit packet sequence number (requests: requester's sq_psn++;
 *                     responses echo the request's psn)
 *   12  4    length   payload bytes that follow (READ_RESP <= KS_MAX_MSG, SEND <= KS_MAX_SEND)
 *   16  4    rkey     READ_REQ: remote key
 *   20  4    rlen     READ_REQ: bytes to read
 *   24  8    raddr    READ_REQ: remote virtual address
 *
 * One TCP connection per (requester QP -> responder QP) direction: the requester writes
 * requests and reads responses; the responder reads requests and writes responses, in
 * order, so responses match the oldest outstanding request (PSN checked).  HELLO (first
 * message, written by the requester's to_rtr in Python, rdma/providers/soft/wire.py) names
 * dest/src QPN and carries <= 256 bytes of private data; the responder's engine answers
 * with a HELLO whose status is 0 (accepted) or REM_INV_REQ_ERR (no such QP / not the peer
 * it expects / QP busy / ERR).  HELLO header: psn, rkey, rlen, raddr, status and the
 * payload's reserved word are 0, both QPNs fit in 24 bits.
 * Anything malformed, truncated, oversized or out of order drops that connection and moves
 * that QP to ERR; nothing else is affected.
 *
 * Hostile-network limits (the reasons are in soft_engine.c's header comment):
 *
 *   KS_HELLO_TIMEOUT_MS     an accepted connection must deliver a valid HELLO within 2 s
 *   KS_MAX_HELLO_CONNS      at most 256 such pending connections in all, and
 *   KS_MAX_HELLO_PER_SRC    64 per source IPv4 address; a new connection over either cap
 *                           evicts the oldest pending one (of its own source first), so
 *                           idle connections can delay a HELLO but never lock it out
 *   KS_QP_CANDIDATES        a QP in RESET/INIT holds at most 4 HELLO'd connections whose
 *                           sender it cannot check yet; at RTR it keeps the one from
 *                           (dest QPN, peer address) and closes the others.  A QP told
 *                           whom to expect (SoftQP.expect_peer: QPN, address, private
 *                           data) refuses every other HELLO at once.
 *   QPNs                    24-bit random (getrandom), unique per engine, never 0 or 1:
 *                           a HELLO must first guess a live QPN.
 *
 * Threads and locks: one engine (one epoll thread) per opened soft device.  The engine
 * thread and the Python threads that post/modify share `e->lock`; it is never held
 * across a blocking call (every socket is non-blocking; TCP connect happens in Python
 * before the fd is handed over).  CQs have their own `cq->lock` so polling never waits
 * for the engine's socket I/O; `e->cq_tab_lock` guards the CQ table for lookups.
 *
 * Lock order: e->lock -> e->cq_tab_lock -> cq->lock.
 */
#ifndef KSPEEDFS_SOFT_ENGINE_H
#define KSPEEDFS_SOFT_ENGINE_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "tuning.h"

#define KS_MAGIC 0x4452534Bu /* "KSRD" little-endian */
#define KS_VERSION 1
#define KS_HDR_LEN 32
#define KS_MAX_MSG (1u << 30)   /* largest READ payload */
#define KS_MAX_SEND (16u << 20) /* largest SEND payload (control messages) */
#define KS_MAX_PDATA 256
#define KS_HELLO_FIXED 12 /* dest_qpn, src_qpn, reserved */
#define KS_MAX_SGE 16
#define KS_MAX_WR 16384
#define KS_MAX_PENDING (4u << 20) /* buffered SEND bytes with no RECV posted */
#define KS_MAX_QP 4096            /* per engine; qpn: 24 random bits, see qpn_tab */
#define KS_MAX_MR 4096            /* per engine; key = random << 12 | slot */
#define KS_MAX_CQ 1024
#define KS_QP_CANDIDATES 4 /* HELLO'd connections a QP holds before RTR */
#define KS_HELLO_BUF (KS_HDR_LEN + KS_HELLO_FIXED + KS_MAX_PDATA) /* largest HELLO */

enum ks_opcode {
    KS_OP_HELLO = 1,
    KS_OP_READ_REQ = 2,
    KS_OP_READ_RESP = 3,
    KS_OP_SEND = 4,
    KS_OP_SEND_ACK = 5,
};

/* ibv values (rdma/enums.py mirrors these) */
enum { KS_QPS_RESET = 0, KS_QPS_INIT = 1, KS_QPS_RTR = 2, KS_QPS_RTS = 3, KS_QPS_ERR = 6 };
enum { KS_WR_SEND = 2, KS_WR_RDMA_READ = 4 };
enum { KS_WC_SEND = 0, KS_WC_RDMA_READ = 2, KS_WC_RECV = 128 };
enum {
    KS_WC_SUCCESS = 0,
    KS_WC_LOC_LEN_ERR = 1,
    KS_WC_LOC_QP_OP_ERR = 2,
    KS_WC_LOC_PROT_ERR = 4,
    KS_WC_WR_FLUSH_ERR = 5,
    KS_WC_BAD_RESP_ERR = 7,
    KS_WC_REM_INV_REQ_ERR = 9,
    KS_WC_REM_ACCESS_ERR = 10,
    KS_WC_REM_OP_ERR = 11,
    KS_WC_RETRY_EXC_ERR = 12,
    KS_WC_RNR_RETRY_EXC_ERR = 13,
};
enum { KS_ACCESS_LOCAL_WRITE = 1, KS_ACCESS_REMOTE_WRITE = 2, KS_ACCESS_REMOTE_READ = 4 };
enum { KS_SEND_SIGNALED = 2 };

/* Parser roles */
enum { KS_ROLE_RESPONSES = 1, KS_ROLE_REQUESTS = 0, KS_ROLE_HELLO = 2, KS_ROLE_ANY = -1 };

struct ks_hdr {
    uint32_t magic;
    uint8_t version, opcode, status, flags;
    uint32_t psn, length, rkey, rlen;
    uint64_t raddr;
};

/* Parse and validate a header.  role: KS_ROLE_RESPONSES accepts READ_RESP/SEND_ACK,
 * KS_ROLE_REQUESTS READ_REQ/SEND, KS_ROLE_HELLO only HELLO, KS_ROLE_ANY any opcode.
 * Returns 0 or a negative errno (-EPROTO bad field, -EMSGSIZE length over the opcode's
 * limit).  Never reads past buf[0..KS_HDR_LEN). */
int ks_hdr_parse(const uint8_t *buf, struct ks_hdr *h, int role);
void ks_hdr_build(uint8_t *buf, const struct ks_hdr *h);

/* A parsed HELLO; `pdata` points into the buffer given to ks_hello_parse. */
struct ks_hello {
    uint32_t dest_qpn, src_qpn, pdata_len;
    const uint8_t *pdata;
};

/* Parse the HELLO in buf[0..len): header, then KS_HELLO_FIXED + private data.  Returns 0,
 * -EAGAIN when more bytes are needed (*need = the message's total length, known once the
 * header is in: never above KS_HELLO_BUF), or -EPROTO / -EMSGSIZE.  len must not exceed
 * the message (the caller reads exactly *need bytes).  Never reads past buf[0..len). */
int ks_hello_parse(const uint8_t *buf, uint32_t len, struct ks_hello *out, uint32_t *need);

typedef struct ks_wc {
    uint64_t wr_id;
    uint32_t status, opcode, byte_len, qp_num, vendor_err;
} ks_wc;

typedef struct ks_sge {
    uint64_t addr;
    uint32_t length, lkey;
} ks_sge;

/* A send-queue entry.  `hdr` is the request header, built at post time (the PSN is
 * assigned then), so transmission is a plain gather of hdr + SEND payload.  `cq`: NULL
 * (the Python binding's WRs), or the CQ this WR completes on instead of the QP's send
 * CQ: a native caller's own (ks_post_send says how it differs). */
typedef struct ks_wqe {
    uint64_t wr_id;
    uint32_t opcode, flags, psn, nsge;
    uint64_t total;
    uint64_t raddr;
    uint32_t rkey;
    uint8_t hdr[KS_HDR_LEN];
    ks_sge sge[KS_MAX_SGE];
    struct ks_cq *cq;
} ks_wqe;

/* A receive-queue entry. */
typedef struct ks_rwqe {
    uint64_t wr_id;
    uint32_t nsge;
    uint64_t total;
    ks_sge sge[KS_MAX_SGE];
} ks_rwqe;

/* A queued response on a responder connection: header + (READ) data straight from MR
 * memory.  `mr_key` lets MR deregistration find jobs that still point into the MR. */
typedef struct ks_job {
    uint8_t hdr[KS_HDR_LEN];
    const uint8_t *data;
    uint64_t len;
    uint32_t mr_key;
} ks_job;

typedef struct ks_mr ks_mr;
typedef struct ks_cq ks_cq;
typedef struct ks_qp ks_qp;
typedef struct ks_conn ks_conn;
typedef struct ks_engine ks_engine;
typedef struct ks_pending ks_pending;

/* ------------------------------------------------------------------------- the API
 * Implemented in the engine's files (soft_engine_i.h maps them); the CPython binding
 * (soft_engine_py.c) is its one caller.  Errors are a negative errno plus a static message in *why ("post_send:
 * QP is not in RTS"); -ENOMEM with *why NULL means out of memory.  Each call names the
 * lock its caller must hold.  Objects are found by handle (QPN, MR key, CQ id) under
 * that lock and stay valid until their own remove call: the engine thread never frees
 * one, and quiesce() (which drops e->lock while the engine reads into memory) is only
 * waited on by calls whose caller serialises them (the binding holds the GIL). */

struct ks_stats {
    uint64_t dropped_conns, rx_bytes, tx_bytes;
    uint64_t hello_evicted, hello_timeouts, hello_refused;
    uint64_t doorbell_posts; /* posts whose requests the engine thread sent */
    int conns, qps, pending_hello;
};

struct ks_qp_attr {
    int pd, scq, rcq, sig_all;
    uint32_t max_send_wr, max_recv_wr, max_send_sge, max_recv_sge;
};

/* Engine: a listener on ip:port (network order; port 0: ephemeral) and its thread. */
int ks_engine_open(uint32_t ip, int port, ks_engine **out, const char **why);
void ks_engine_close(ks_engine *e);     /* no lock; stops the thread, frees all */
int ks_engine_port(const ks_engine *e); /* no lock: fixed at open */
int ks_engine_trylock(ks_engine *e);    /* e->lock: 0 when taken */
void ks_engine_lock(ks_engine *e);
void ks_engine_unlock(ks_engine *e);
void ks_engine_kick(ks_engine *e); /* no lock: re-plan the engine's sleep */
void ks_engine_stats(ks_engine *e, struct ks_stats *st); /* e->lock */

/* MRs.  ks_mr_new: not yet visible to the engine (no lock); ks_mr_add returns its key,
 * 0 when all KS_MAX_MR slots are taken; after ks_mr_dereg nothing touches the memory,
 * and ks_mr_free may follow once e->lock is dropped. */
int ks_mr_new(int pd, uint64_t addr, uint64_t length, int access, ks_mr **out,
              const char **why);
uint32_t ks_mr_add(ks_engine *e, ks_mr *mr);  /* e->lock */
ks_mr *ks_mr_get(ks_engine *e, uint32_t key); /* e->lock */
void ks_mr_dereg(ks_engine *e, ks_mr *mr);    /* e->lock */
void ks_mr_free(ks_mr *mr);

/* CQs.  ks_cq_add returns the id or -ENOMEM (KS_MAX_CQ in use); ids passed in are in
 * [0, KS_MAX_CQ).  Moderation and polling take e->cq_tab_lock themselves, never e->lock,
 * so they never wait for the engine's socket I/O; both fail -EBADF on a destroyed CQ. */
int ks_cq_new(int cqe, ks_cq **out, const char **why);
int ks_cq_add(ks_engine *e, ks_cq *cq); /* e->lock */
int ks_cq_efd(const ks_cq *cq);
ks_cq *ks_cq_get(ks_engine *e, int id);                      /* e->lock */
int ks_cq_remove(ks_engine *e, ks_cq *cq, const char **why); /* e->lock; -EBUSY */
void ks_cq_free(ks_cq *cq);
int ks_cq_moderate(ks_engine *e, int id, uint32_t count, uint32_t period_us,
                   const char **why); /* no lock */
int ks_cq_poll(ks_engine *e, int id, ks_wc *wc, int num,
               const char **why); /* no lock; returns the count */

/* QPs.  ks_qp_add returns the QPN (24 random bits) or a negative errno; the modify calls
 * are the verbs transitions (ks_qp_init: RESET -> INIT). */
int ks_qp_new(const struct ks_qp_attr *a, ks_qp **out, const char **why);
int ks_qp_add(ks_engine *e, ks_qp *qp, const struct ks_qp_attr *a, const char **why);
ks_qp *ks_qp_get(ks_engine *e, uint32_t qpn); /* e->lock */
void ks_qp_remove(ks_engine *e, ks_qp *qp);   /* e->lock */
void ks_qp_free(ks_qp *qp);
int ks_qp_state(const ks_qp *qp); /* e->lock */
/* ns since a byte of a response last arrived on the QP (-1: never): the peer and the
 * path are alive however long the READ it belongs to takes (vRDMA liveness) */
int64_t ks_qp_rx_age(const ks_qp *qp); /* e->lock */
/* the HELLO's private data into buf[KS_MAX_PDATA]: its length, -1 for none */
int ks_qp_private_data(const ks_qp *qp, uint8_t *buf); /* e->lock */
void ks_qp_init(ks_qp *qp, int access);                /* e->lock */
void ks_qp_set_access(ks_qp *qp, int access);          /* e->lock */
/* INIT -> RTR: adopt the connected (HELLO-acknowledged) requester socket fd */
int ks_qp_to_rtr(ks_engine *e, ks_qp *qp, int fd, uint32_t dest_qpn, uint32_t rq_psn,
                 const char **why); /* e->lock */
/* RESET/INIT only: from now on only a HELLO from src_qpn at ip (0: any address) carrying
 * exactly pdata (pdata_len -1: any) may connect; candidates that do not match are
 * closed.  Cleared by RESET. */
int ks_qp_expect(ks_engine *e, ks_qp *qp, uint32_t src_qpn, uint32_t ip, const uint8_t *pdata,
                 int pdata_len, const char **why); /* e->lock */
int ks_qp_to_rts(ks_qp *qp, uint32_t sq_psn, uint64_t timeout_ns, int set_psn,
                 const char **why);           /* e->lock */
void ks_qp_to_reset(ks_engine *e, ks_qp *qp); /* e->lock */
void ks_qp_to_err(ks_engine *e, ks_qp *qp);   /* e->lock */

/* Posting takes e->lock itself (the binding calls it without the GIL).  A WR that fails a check on
 * its memory completes with an error WC (the post succeeds); the errors returned are
 * about the post itself (unknown QP, wrong state, queue full, too many SGEs).
 * A WR with its own `cq` (a C caller beside Python on the same QP: the FUSE engine's
 * chunk fetch) completes there, always signalled, and always completes: where a QP's
 * reset or destruction drops the binding's WRs without a WC (as verbs does; the vQP
 * takes those back itself), such a WR completes WR_FLUSH_ERR, so its poster never waits
 * on a QP that Python rebuilt.  Its CQ counts it as a user (ks_cq_remove: -EBUSY) until
 * its WC is pushed. */
int ks_post_send(ks_engine *e, uint32_t qpn, const ks_wqe *wrs, size_t n, const char **why);
int ks_post_recv(ks_engine *e, uint32_t qpn, const ks_rwqe *wrs, size_t n, const char **why);

/* ------------------------------------------------------------------ the C API
 * For another extension module in the same process (the FUSE engine's chunk fetch): the
 * capsule rdma._soft_engine._C_API ("rdma._soft_engine._C_API") holds one of these.
 * `hold` (GIL held) turns an rdma._soft_engine.Engine object into its engine and keeps
 * it open: Engine.close() raises EBUSY until `release` (GIL held) is called as often;
 * NULL with a Python exception set when `obj` is not an open Engine.  The rest run
 * without the GIL, on engines held.  `cq_open` creates and adds a CQ (its id and
 * eventfd in *id, *efd); `cq_close` removes and frees it (-EBUSY while a WR posted with
 * it has not completed: ks_post_send). */
#define KS_CAPI_NAME "rdma._soft_engine._C_API"
#define KS_CAPI_ABI 1

struct ks_capi {
    int abi;                       /* KS_CAPI_ABI */
    ks_engine *(*hold)(void *obj); /* obj: PyObject * */
    void (*release)(void *obj);
    int (*post_send)(ks_engine *e, uint32_t qpn, const ks_wqe *wrs, size_t n,
                     const char **why);
    int (*cq_open)(ks_engine *e, int cqe, ks_cq **out, int *id, int *efd, const char **why);
    int (*cq_close)(ks_engine *e, ks_cq *cq, const char **why);
    int (*cq_poll)(ks_engine *e, int id, ks_wc *wc, int num, const char **why);
};

#endif
