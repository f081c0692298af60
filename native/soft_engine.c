/* soft_engine.c — native data path of the soft RDMA provider (see soft_engine.h): the
 * engine itself (its thread: the epoll loop, transport timers, the doorbell; open, close
 * and stats), and the design notes of all its files (soft_engine_i.h maps them).
 *
 * Design notes
 * ------------
 * * One `ks_engine` per opened soft device: a listening TCP socket on the device's IPv4
 *   address, an epoll set, and one pthread.  These files are the engine alone, C with no
 *   Python; its API (declared in soft_engine.h) is what the CPython binding,
 *   soft_engine_py.c, calls once it has parsed its arguments, and what native/fuzz
 *   drives.  The binding takes `e->lock` itself, so that it can drop the
 *   GIL while it waits.
 * * Requester: post_send builds the request header (PSN assigned) and appends the WQE to
 *   the QP's send ring.  On a QP with nothing outstanding it tries a non-blocking
 *   sendmsg() on the QP's outgoing connection at once (a lone READ's latency); on a busy
 *   one it rings a doorbell (the kick fd, once until answered) and the engine thread
 *   sends, as a NIC's send engine would: the poster (the FUSE engine's trio thread,
 *   which posts every chunk of a stream) stops paying the sendmsg, and on veth the
 *   receiving side's TCP softirq that runs inside it.  A lone random READ keeps its
 *   inline send (a doorbell for each would cost IOPS); a READ of a whole chunk
 *   (KS_DOORBELL_READ or more) rings the doorbell on an idle QP too, since the engine
 *   thread's wake is small beside a chunk's transfer and the inline sendmsg was the trio
 *   thread's largest syscall.  The measurements: docs/design.md, "The soft engine's
 *   doorbell and quick ACKs".  Whatever does not fit the socket is finished by the
 *   engine thread on EPOLLOUT.
 *   READ responses are read with readv() straight into the WQE's SGEs (registered
 *   memory); only headers and payloads <= KS_SMALL go through a staging buffer.
 * * Responder: the engine thread reads requests from the incoming connection, checks
 *   rkey / PD / bounds / access and queues a response whose payload is the MR memory
 *   itself (sendmsg() from the MR); no application involvement, no copy in user space.
 * * ACKs go out at once, as an RC NIC's do: every receive re-arms TCP_QUICKACK on its
 *   connection (ack_now).  Left to itself Linux puts a connection that both sends and
 *   receives into "pingpong" mode and delays its ACKs up to 40 ms, hoping to piggyback
 *   them; a sender whose congestion window is then full waits for them, and READ
 *   responses of live peers stalled tens of ms mid-payload (docs/design.md, "The soft
 *   engine's doorbell and quick ACKs").  Cost: one setsockopt per receive handler call.
 * * Transport timer: like IB's Local ACK Timeout, a QP with outstanding send WRs must see
 *   progress (bytes moving on its connection) within timeout x (retry_cnt + 1), else the
 *   oldest WR completes RETRY_EXC_ERR and the QP goes to ERR.  TCP alone would hang on a
 *   SIGSTOPped peer or a dead NIC; this timer is what turns that into an error.
 * * Memory safety: every access to MR memory happens with `e->lock` held, and
 *   deregistration (also under the lock) first kills every connection / QP whose queued
 *   work still points into the MR, so after dereg_mr() returns the engine never touches
 *   that memory again.  Responder bounds checks are overflow-safe.
 * * Completions: `cq->lock` protects the WC ring; the CQ's eventfd is written when the
 *   ring goes non-empty and drained when poll empties it (level-triggered readability).
 *
 * Hostile network
 * ---------------
 * Anyone who can reach the listener can open connections and send bytes; nothing they
 * send may crash the process, touch another QP, or keep a legitimate QP from connecting.
 * * Parsing is total: ks_hdr_parse checks every header field against its opcode and
 *   direction, ks_hello_parse the HELLO's length, QPNs (24 bits) and reserved word, before
 *   anything is used; a pending connection reads at most KS_HELLO_BUF (300 B) into a
 *   buffer of that size.  Any error closes that one connection (and moves its QP to ERR
 *   once attached).  native/fuzz/fuzz_engine.c fuzzes these and the connection handlers
 *   under ASan/UBSan (~100k inputs/s; tests/rdma/test_soft_fuzz.py).
 * * Pending connections (accepted, no valid HELLO yet) are bounded: 2 s to deliver the
 *   HELLO (a real one is written right after connect(); 2 s still covers one lost SYN-ACK
 *   or data segment at Linux's 1 s initial RTO), 64 per source address and 256 in all.
 *   A new connection over a cap evicts the oldest pending one, of its own source first:
 *   a flood only ever evicts itself (or, from 4+ addresses, the oldest of everyone), and
 *   a legitimate HELLO is lost only if 64 newer connections from its own address are
 *   accepted before its bytes are read.  Each pending connection costs one fd and ~1 KiB;
 *   the listener accepts KS_ACCEPT_BATCH at a time and reads the HELLO at once, and on
 *   EMFILE pauses KS_LISTEN_PAUSE_MS instead of spinning.  Measured
 *   (tests/rdma/test_soft_hostile.py): with 1500 idle connections held open from
 *   127.0.0.1, at most 64 are pending, a new QP pair connects and READs 1 MiB, and fds
 *   and RSS are back at their baseline once the flood closes.
 * * QPNs are 24 random bits (getrandom), so a HELLO must first guess a live QPN (1 in
 *   ~4000 per try with 4096 QPs, 1 in 16M with one); they are looked up in `qpn_tab`.
 * * A QP in RESET/INIT cannot check a HELLO (the peer's QPN and address come with RTR),
 *   so up to KS_QP_CANDIDATES wait (refused beyond that: first come, first served); RTR
 *   keeps the one from (dest QPN, the address we connected to) and closes the others.
 *   expect_peer() (vRDMA: the client QPN and HMAC token exchanged on the authenticated
 *   channel) lets the QP refuse every other HELLO at once, so strangers never take
 *   those slots.  Without it, a stranger who guessed the QPN and sent 4 HELLOs before
 *   the peer has the peer refused (tests/rdma/test_soft_hostile.py shows both).
 */
#define _GNU_SOURCE
#include "soft_engine_i.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static char TAG_LISTEN, TAG_KICK;

/* Wait until the engine thread is not inside an unlocked readv (caller holds e->lock;
 * a no-op on the engine thread itself, which never calls this while rx_busy). */
void quiesce(ks_engine *e)
{
    if (!e->rx_busy)
        return;
    e->quiescing++;
    while (e->rx_busy)
        pthread_cond_wait(&e->rx_cond, &e->lock);
    e->quiescing--;
}

/* The engine and the posting/polling thread hold these locks for microseconds at a time:
 * spin a little before sleeping in the kernel (each futex sleep is a context switch). */
void mutex_init_adaptive(pthread_mutex_t *m)
{
    pthread_mutexattr_t a;
    pthread_mutexattr_init(&a);
    pthread_mutexattr_settype(&a, PTHREAD_MUTEX_ADAPTIVE_NP);
    pthread_mutex_init(m, &a);
    pthread_mutexattr_destroy(&a);
}

uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Post one event to an eventfd (a CQ's completion fd, or the engine's kick fd). The
 * result is ignored on purpose: the only failure is EAGAIN on a counter already at its
 * maximum, and then the reader is woken anyway. */
void efd_post(int fd)
{
    uint64_t one = 1;
    ssize_t r = write(fd, &one, sizeof one);
    (void)r;
}

/* ------------------------------------------------------------------- engine thread */

void listener_events(ks_engine *e, uint32_t events)
{
    struct epoll_event ev = {.events = events, .data.ptr = &TAG_LISTEN};
    epoll_ctl(e->epfd, EPOLL_CTL_MOD, e->lfd, &ev);
}

/* Transport timers and HELLO deadlines.  Returns the epoll timeout in ms. */
static int run_timers(ks_engine *e)
{
    uint64_t now = now_ns();
    uint64_t next = now + 1000000000ull;
    for (uint32_t i = 0; i < e->qp_hi; i++) {
        ks_qp *qp = e->qps[i];
        if (!qp || qp->state != KS_QPS_RTS || !qp->timeout_ns)
            continue;
        if (qp->sq_head == qp->sq_tail) {
            if (now + 50000000ull < next)
                next = now + 50000000ull; /* a post may arm the timer while we sleep */
            continue;
        }
        uint64_t dl = qp->last_progress + qp->timeout_ns;
        if (dl <= now) {
            e->n_dropped_conns++;
            qp_fatal(e, qp, KS_WC_RETRY_EXC_ERR);
            continue;
        }
        if (dl < next)
            next = dl;
    }
    for (int i = 0; i < KS_MAX_CQ; i++) { /* moderated CQs whose period ran out */
        ks_cq *cq = e->cqs[i];
        if (!cq || cq->mod_count <= 1)
            continue;
        pthread_mutex_lock(&cq->lock);
        if (!cq->signaled && cq->count && cq->first_unsignaled) {
            uint64_t dl = cq->first_unsignaled + cq->mod_period_ns;
            if (dl <= now) {
                efd_post(cq->efd);
                cq->signaled = 1;
            } else if (dl < next) {
                next = dl;
            }
        }
        pthread_mutex_unlock(&cq->lock);
    }
    /* the pending FIFO is in deadline order (one timeout for all) */
    while (e->hello_head && e->hello_head->hello_deadline <= now) {
        e->n_dropped_conns++;
        e->n_hello_timeouts++;
        conn_kill(e, e->hello_head);
    }
    if (e->hello_head && e->hello_head->hello_deadline < next)
        next = e->hello_head->hello_deadline;
    if (e->listen_paused_until) {
        if (e->listen_paused_until <= now) {
            e->listen_paused_until = 0;
            listener_events(e, EPOLLIN);
        } else if (e->listen_paused_until < next) {
            next = e->listen_paused_until;
        }
    }
    uint64_t ms = (next > now ? next - now : 0) / 1000000ull + 1;
    return ms > 1000 ? 1000 : (int)ms;
}

/* Send what QP `qp`'s send queue holds, as far as its socket takes it (EPOLLOUT
 * finishes the rest); a broken connection fails the QP.  Caller holds e->lock. */
void req_send(ks_engine *e, ks_qp *qp)
{
    if (req_tx(e, qp) < 0)
        qp_fatal(e, qp, KS_WC_RETRY_EXC_ERR);
    else if (qp->req)
        conn_update_events(e, qp->req);
}

/* The engine thread, woken by the doorbell: send what posts queued on every QP. */
static void doorbell_answer(ks_engine *e)
{
    e->doorbell = 0;
    for (uint32_t i = 0; i < e->qp_hi; i++) {
        ks_qp *qp = e->qps[i];
        if (!qp || qp->state != KS_QPS_RTS || !qp->req || qp->req->dead ||
            qp->sq_sent == qp->sq_tail)
            continue;
        req_send(e, qp);
    }
}

static void *engine_main(void *arg)
{
    ks_engine *e = arg;
    pthread_setname_np(pthread_self(), "ks-soft-nic"); /* top -H, bench: by role */
    struct epoll_event evs[64];
    int timeout = 100;
    for (;;) {
        int n = epoll_wait(e->epfd, evs, 64, timeout);
        pthread_mutex_lock(&e->lock);
        if (e->stop) {
            pthread_mutex_unlock(&e->lock);
            break;
        }
        pthread_mutex_unlock(&e->lock);
        for (int i = 0; i < n; i++) {
            pthread_mutex_lock(&e->lock);
            void *p = evs[i].data.ptr;
            if (p == &TAG_LISTEN) {
                accept_all(e);
            } else if (p == &TAG_KICK) {
                uint64_t v;
                ssize_t r = read(e->kickfd, &v, sizeof v);
                (void)r;
                if (e->doorbell)
                    doorbell_answer(e);
            } else {
                ks_conn *c = p;
                if (!c->dead)
                    handle_conn(e, c, evs[i].events);
            }
            signal_flush(e);
            pthread_mutex_unlock(&e->lock);
        }
        pthread_mutex_lock(&e->lock);
        uint64_t now = now_ns();
        if (n == 0 || now - e->last_timer > 1000000ull) {
            timeout = run_timers(e);
            e->last_timer = now;
        } else {
            timeout = 1; /* timers were skipped (busy): look again within 1 ms */
        }
        graveyard_free(e);
        signal_flush(e);
        pthread_mutex_unlock(&e->lock);
    }
    return NULL;
}


/* ============================================================================ the API
 * What soft_engine.h declares, for the binding (soft_engine_py.c).  Each call says which
 * lock its caller holds; errors are a negative errno and a static message in *why
 * (-ENOMEM with *why NULL: out of memory). */

/* ------------------------------------------------------------------------- engine */

int ks_engine_open(uint32_t ip, int port, ks_engine **out, const char **why)
{
    *why = NULL;
    ks_engine *e = calloc(1, sizeof *e);
    if (!e)
        return -ENOMEM;
    e->epfd = e->lfd = e->kickfd = -1;
    mutex_init_adaptive(&e->lock);
    mutex_init_adaptive(&e->cq_tab_lock);
    pthread_cond_init(&e->rx_cond, NULL);
    struct sockaddr_in sa = {.sin_family = AF_INET,
                             .sin_port = htons(port),
                             .sin_addr.s_addr = ip};
    e->ip = ip;
    e->epfd = epoll_create1(EPOLL_CLOEXEC);
    e->kickfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    e->lfd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    int one = 1;
    if (e->epfd < 0 || e->kickfd < 0 || e->lfd < 0 ||
        setsockopt(e->lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) < 0 ||
        bind(e->lfd, (struct sockaddr *)&sa, sizeof sa) < 0 || listen(e->lfd, 256) < 0) {
        int err = errno;
        ks_engine_close(e);
        *why = "soft engine listener";
        return -err;
    }
    socklen_t sl = sizeof sa;
    getsockname(e->lfd, (struct sockaddr *)&sa, &sl);
    e->port = ntohs(sa.sin_port);
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &TAG_LISTEN};
    epoll_ctl(e->epfd, EPOLL_CTL_ADD, e->lfd, &ev);
    struct epoll_event ev2 = {.events = EPOLLIN, .data.ptr = &TAG_KICK};
    epoll_ctl(e->epfd, EPOLL_CTL_ADD, e->kickfd, &ev2);
    int err = pthread_create(&e->thread, NULL, engine_main, e);
    if (err) {
        ks_engine_close(e);
        *why = "soft engine thread";
        return -err;
    }
    e->thread_started = 1;
    *out = e;
    return 0;
}

void ks_engine_close(ks_engine *e)
{
    if (!e)
        return;
    if (e->thread_started) {
        pthread_mutex_lock(&e->lock);
        e->stop = 1;
        pthread_mutex_unlock(&e->lock);
        efd_post(e->kickfd);
        pthread_join(e->thread, NULL);
        e->thread_started = 0;
    }
    for (ks_conn *c = e->conns, *n; c; c = n) {
        n = c->next;
        conn_kill(e, c);
    }
    graveyard_free(e);
    for (int i = 0; i < KS_MAX_QP; i++) {
        ks_qp_free(e->qps[i]);
        e->qps[i] = NULL;
    }
    for (int i = 0; i < KS_MAX_MR; i++) {
        ks_mr_free(e->mrs[i]);
        e->mrs[i] = NULL;
    }
    for (int i = 0; i < KS_MAX_CQ; i++) {
        ks_cq_free(e->cqs[i]);
        e->cqs[i] = NULL;
    }
    if (e->lfd >= 0)
        close(e->lfd);
    if (e->kickfd >= 0)
        close(e->kickfd);
    if (e->epfd >= 0)
        close(e->epfd);
    pthread_mutex_destroy(&e->lock);
    pthread_mutex_destroy(&e->cq_tab_lock);
    pthread_cond_destroy(&e->rx_cond);
    free(e);
}

int ks_engine_port(const ks_engine *e) { return e->port; }
int ks_engine_trylock(ks_engine *e) { return pthread_mutex_trylock(&e->lock); }
void ks_engine_lock(ks_engine *e) { pthread_mutex_lock(&e->lock); }
void ks_engine_unlock(ks_engine *e) { pthread_mutex_unlock(&e->lock); }
void ks_engine_kick(ks_engine *e) { efd_post(e->kickfd); }

void ks_engine_stats(ks_engine *e, struct ks_stats *st)
{
    st->dropped_conns = e->n_dropped_conns;
    st->rx_bytes = e->n_rx_bytes;
    st->tx_bytes = e->n_tx_bytes;
    st->hello_evicted = e->n_hello_evicted;
    st->hello_timeouts = e->n_hello_timeouts;
    st->hello_refused = e->n_hello_refused;
    st->doorbell_posts = e->n_doorbell_posts;
    st->pending_hello = e->n_hello;
    st->conns = 0;
    for (ks_conn *c = e->conns; c; c = c->next)
        st->conns++;
    st->qps = 0;
    for (uint32_t i = 0; i < e->qp_hi; i++)
        st->qps += e->qps[i] != NULL;
}
