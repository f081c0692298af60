/* soft_engine_i.h — what crosses the soft engine's files: its objects, and the functions
 * one file defines and another calls (soft_engine.h is the API, for the binding).
 *
 * The engine's files (soft_engine.c has the design notes):
 *   soft_engine.c      the engine thread (epoll loop, transport timers, doorbell), open,
 *                      close, stats; helpers (now_ns, efd_post, quiesce)
 *   soft_wire.c        the header and the HELLO on the wire: build, parse
 *   soft_transport.c   TCP connections, pending ones and their HELLO, accepting
 *   soft_qp.c          the QPN table, QP state and errors, the QP API, posting WRs
 *   soft_requester.c   SGE arithmetic; requests sent, responses read into SGEs
 *   soft_responder.c   requests checked and answered from MR memory; SENDs delivered
 *   soft_cq.c          the WC ring and eventfd of a CQ; the CQ API
 *   soft_mr.c          the MR API: registration, deregistration
 *
 * Every function declared here is hidden: the extension exports only what soft_engine.h
 * names.
 */
#ifndef KSPEEDFS_SOFT_ENGINE_I_H
#define KSPEEDFS_SOFT_ENGINE_I_H

#include <pthread.h>
#include <stdint.h>

#include "soft_engine.h"

#define KS_IOV 64
#define KS_QPN_TAB (2 * KS_MAX_QP) /* open-addressing QPN -> QP table, load <= 1/2 */

/* Every field names its guard.  `e` is the object's engine throughout; "read-only" fields
 * are set before the object is published in an engine table and never change after. */

struct ks_mr {
    uint32_t key;          /* read-only (the slot bits are set by ks_mr_add) */
    int pd;                /* read-only */
    uint64_t addr, length; /* read-only */
    int access;            /* read-only */
};

struct ks_cq {
    int id;                  /* read-only */
    int efd;                 /* read-only */
    int kickfd;              /* read-only; the engine's: wake it to time a moderation period */
    pthread_t engine_thread; /* read-only */
    ks_cq **defer;           /* read-only: &e->defer_sig */
    pthread_mutex_t lock;
    ks_wc *ring;               /* protected by cq->lock */
    uint32_t cap, head, count; /* protected by cq->lock */
    /* Moderation (ibv_modify_cq): the eventfd is written once `mod_count` WCs are queued
     * or `mod_period_ns` after the first unsignalled one, whichever is first; count <= 1
     * means every WC signals.  `signaled`: the eventfd has been written since the ring
     * was last emptied. */
    uint32_t mod_count;                       /* protected by cq->lock */
    uint64_t mod_period_ns, first_unsignaled; /* protected by cq->lock */
    int signaled;                             /* protected by cq->lock */
    int refs;                                 /* QPs using this CQ; protected by e->lock */
};

struct ks_pending {
    struct ks_pending *next;
    uint32_t len;
    uint8_t data[];
};

enum { CONN_HELLO = 0, CONN_REQ = 1, CONN_RESP = 2 };

/* A connection is reached only through e->conns and its QP, so every field is
 * protected by e->lock (the engine thread drops it around one readv: see rx_busy). */
struct ks_conn {
    int fd;               /* protected by e->lock */
    int role;             /* protected by e->lock */
    int dead;             /* protected by e->lock */
    ks_qp *qp;            /* protected by e->lock */
    ks_conn *next, *prev; /* e->conns list; protected by e->lock */
    ks_conn *next_dead;   /* graveyard, freed after the engine's batch; protected by e->lock */
    uint32_t events;      /* current epoll mask; protected by e->lock */
    uint64_t hello_deadline; /* protected by e->lock */
    /* CONN_HELLO: e->hello_head FIFO, oldest first; protected by e->lock */
    ks_conn *hnext, *hprev;
    /* accepted connections: the source IPv4, network order */
    uint32_t peer_ip; /* protected by e->lock */
    /* the HELLO of an accepted connection, kept while it is a candidate of a QP in
     * RESET/INIT (qp->cand) and copied to the QP when it attaches */
    uint32_t src_qpn;            /* protected by e->lock */
    int pdata_len;               /* protected by e->lock */
    uint8_t pdata[KS_MAX_PDATA]; /* protected by e->lock */
    /* rx */
    uint8_t *stage;      /* protected by e->lock */
    uint32_t spos, slen; /* protected by e->lock */
    int in_payload;      /* protected by e->lock */
    struct ks_hdr cur;   /* protected by e->lock */
    uint64_t pay_off;    /* protected by e->lock */
    uint8_t *sendbuf;    /* responder: SEND payload being received; protected by e->lock */
    /* tx */
    uint64_t tx_off; /* bytes of the first queued item already sent; protected by e->lock */
    int lowat;       /* current SO_RCVLOWAT (requester); protected by e->lock */
    /* responder jobs ring */
    ks_job *jobs;           /* protected by e->lock */
    uint32_t jhead, jcount; /* protected by e->lock */
    int fatal_after; /* a NAK is queued: QP -> ERR once it is sent; protected by e->lock */
};

struct ks_qp {
    uint32_t qpn;     /* read-only */
    uint32_t slot;    /* index in e->qps; read-only */
    int pd;           /* read-only */
    int sig_all;      /* read-only */
    ks_cq *scq, *rcq; /* read-only */
    uint32_t max_send_wr, max_recv_wr, max_send_sge, max_recv_sge; /* read-only */
    uint32_t qpn_draws[8]; /* ks_qp_new's random QPNs for ks_qp_add; read-only */
    int state;             /* protected by e->lock */
    int access;            /* protected by e->lock */
    ks_wqe *sq;            /* ring contents protected by e->lock */
    /* ring counters (sq_*, rq_*) are free-running: slot n % max_send_wr / max_recv_wr */
    uint32_t sq_head, sq_sent, sq_tail; /* protected by e->lock */
    ks_rwqe *rq;                        /* ring contents protected by e->lock */
    uint32_t rq_head, rq_tail;          /* protected by e->lock */
    uint32_t sq_psn, rq_psn;            /* protected by e->lock */
    uint32_t dest_qpn;                  /* protected by e->lock */
    uint64_t timeout_ns;                /* 0: infinite; protected by e->lock */
    uint64_t last_progress;             /* protected by e->lock */
    uint64_t last_rx;                   /* a response byte last arrived (0: never); e->lock */
    ks_conn *req, *resp;                /* protected by e->lock */
    /* RESET/INIT: HELLO'd connections not yet checkable (the peer's QPN and address are
     * only known at RTR); RTR keeps the one that matches, if any, as `resp` */
    ks_conn *cand[KS_QP_CANDIDATES]; /* protected by e->lock */
    int ncand;                       /* protected by e->lock */
    uint32_t peer_ip;                /* RTR: the peer device's IPv4; protected by e->lock */
    /* expect_peer(): only a HELLO from this QPN (and address, and private data) may
     * attach; set in RESET/INIT, cleared by RESET */
    int expect;                         /* protected by e->lock */
    uint32_t expect_qpn, expect_ip;     /* expect_ip 0: any address; protected by e->lock */
    int expect_pdata_len;               /* -1: any private data; protected by e->lock */
    uint8_t expect_pdata[KS_MAX_PDATA]; /* protected by e->lock */
    uint8_t pdata[KS_MAX_PDATA];        /* protected by e->lock */
    int pdata_len;                      /* -1: none received; protected by e->lock */
    uint32_t resp_src_qpn;              /* protected by e->lock */
    ks_pending *pend_head, *pend_tail;  /* protected by e->lock */
    uint64_t pend_bytes;                /* protected by e->lock */
};

struct ks_engine {
    pthread_mutex_t lock;
    pthread_t thread;      /* read-only once started */
    int thread_started;    /* ks_engine_open / ks_engine_close only */
    int epfd, lfd, kickfd; /* read-only */
    uint32_t ip;           /* network order; read-only */
    int port;              /* read-only */
    int stop;              /* protected by e->lock */
    /* The engine thread drops `lock` around the bulk readv() of a READ response into
     * registered memory (the hot path; holding the lock there stalled every post_send
     * for milliseconds).  While `rx_busy` is set nobody may close that socket, flush or
     * reset its QP, or deregister memory: those paths call quiesce() first, which waits
     * on `rx_cond`.  post_send/post_recv only append to the rings and need not wait.
     * While one waits (`quiescing`), the engine starts no new unlocked readv: else, with
     * READ responses streaming on several sockets, it set `rx_busy` again before the
     * woken waiter had the lock, and a QP's move to ERR waited 23-30 ms of a 40 ms stream
     * (tests/rdma/test_soft_faults.py), up to 101 ms in the 4-reader peer loop, with the
     * GIL held: every Python thread of the mount stood still. */
    int rx_busy;                /* protected by e->lock */
    int quiescing;              /* threads in quiesce(); protected by e->lock */
    pthread_cond_t rx_cond;     /* waited on with e->lock */
    ks_qp *qps[KS_MAX_QP];      /* protected by e->lock */
    ks_qp *qpn_tab[KS_QPN_TAB]; /* by QPN (linear probing); protected by e->lock */
    uint32_t qp_hi;             /* highest used slot + 1; protected by e->lock */
    ks_mr *mrs[KS_MAX_MR];      /* protected by e->lock */
    pthread_mutex_t cq_tab_lock;
    ks_cq *cqs[KS_MAX_CQ]; /* protected by e->cq_tab_lock (writers hold e->lock too) */
    ks_conn *conns;        /* protected by e->lock */
    ks_conn *dead;         /* protected by e->lock */
    int n_hello;           /* protected by e->lock */
    ks_conn *hello_head, *hello_tail; /* pending (CONN_HELLO) FIFO; protected by e->lock */
    uint64_t listen_paused_until;     /* engine thread only; 0: accepting */
    uint64_t last_timer;              /* engine thread only */
    /* A CQ whose eventfd the engine thread still owes a write: cq_push on the engine
     * thread defers the wake-up of the poller until just before the engine releases
     * `lock`, so the woken thread's post_send does not find the lock taken (and sleep
     * on it) while the engine finishes the event. */
    ks_cq *defer_sig; /* protected by e->lock */
    /* A post queued WRs the engine thread has not sent yet, and wrote the kick fd: */
    int doorbell;                                                /* protected by e->lock */
    uint64_t n_dropped_conns, n_rx_bytes, n_tx_bytes;            /* protected by e->lock */
    uint64_t n_doorbell_posts;                                   /* protected by e->lock */
    uint64_t n_hello_evicted, n_hello_timeouts, n_hello_refused; /* protected by e->lock */
};

#pragma GCC visibility push(hidden)

/* soft_engine.c */
void quiesce(ks_engine *e);
void mutex_init_adaptive(pthread_mutex_t *m);
uint64_t now_ns(void);
void efd_post(int fd);
void listener_events(ks_engine *e, uint32_t events);
void req_send(ks_engine *e, ks_qp *qp);

/* soft_cq.c */
void signal_flush(ks_engine *e);
void push_wc(ks_cq *cq, uint64_t wr_id, uint32_t status, uint32_t opcode, uint32_t byte_len,
             uint32_t qpn);
uint32_t wc_opcode_of(uint32_t wr_opcode);
void send_wc(ks_qp *qp, ks_wqe *w, uint32_t status, uint32_t byte_len);
void sq_drop(ks_qp *qp);

/* soft_transport.c */
void conn_update_events(ks_engine *e, ks_conn *c);
ks_conn *conn_new(ks_engine *e, int fd, int role);
void conn_kill(ks_engine *e, ks_conn *c);
void graveyard_free(ks_engine *e);
int hello_is_peer(const ks_qp *qp, const ks_conn *c);
int conn_attach(ks_engine *e, ks_qp *qp, ks_conn *c);
void conn_drop(ks_engine *e, ks_conn *c, int err, uint32_t status);
int resp_flush(ks_engine *e, ks_qp *qp, ks_conn *c);
void handle_conn(ks_engine *e, ks_conn *c, uint32_t ev);
void accept_all(ks_engine *e);

/* soft_qp.c */
void qp_fatal_at(ks_engine *e, ks_qp *qp, uint32_t culprit, uint32_t status);
void qp_fatal(ks_engine *e, ks_qp *qp, uint32_t status);

/* soft_requester.c */
void sge_copy_in(const ks_sge *sge, uint32_t nsge, uint64_t off, const uint8_t *src,
                 uint64_t len);
int sge_ok(ks_engine *e, int pd, const ks_sge *s, int need_write);
int req_tx(ks_engine *e, ks_qp *qp);
void stage_compact(ks_conn *c);
void ack_now(ks_conn *c);
int req_rx(ks_engine *e, ks_qp *qp, ks_conn *c);

/* soft_responder.c */
int resp_rx_enabled(ks_conn *c);
void deliver_pending(ks_engine *e, ks_qp *qp);
int resp_consume(ks_engine *e, ks_qp *qp, ks_conn *c);
int resp_rx(ks_engine *e, ks_qp *qp, ks_conn *c);
int resp_tx(ks_engine *e, ks_conn *c);

#pragma GCC visibility pop

#endif
