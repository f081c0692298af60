/* fuse_uring.c — FUSE over io_uring: a queue per CPU, its entries registered, requests
 * served from CQEs by the queue's pinned thread and committed; Python's replies handed
 * over through a mailbox the queue's thread drains. */
#define _GNU_SOURCE
#include "fuse_engine_i.h"

#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

/* io_uring queues. 32 entries per queue: an entry stays with Python for a whole miss
 * (milliseconds), and a queue without a free entry parks every request of its CPU, hits
 * and metadata too, in the kernel until a commit; 32 per CPU is, on 2 CPUs, the default
 * max_background (64) of requests in flight. Each entry's payload is max_pages pages
 * (1 MiB), mapped lazily: 32 MiB of address space per CPU, resident as far as replies
 * touched it. */
#define FE_URING_MAX_Q 256 /* qids are CPU numbers */
#define FE_URING_MAX_ENTS 256
#define FE_URING_SLOTS 64 /* engines with rings per process (ring tokens) */

/* liburing, not raw io_uring_setup/enter: the ring's memory barriers, the SQE128 layout
 * and submit-and-wait are its code, tested against many kernels, and Debian 12 ships it
 * (liburing 2.3: SQE128, IORING_OP_URING_CMD, SINGLE_ISSUER, DEFER_TASKRUN); the raw
 * syscalls would save one shared library and buy ~200 lines of ring bookkeeping here.
 *
 * Who submits: only a queue's own thread, pinned to the queue's CPU. Python's replies
 * (a miss answered from trio) are copied into the entry by Python's thread, which then
 * hands the entry's index over through the queue's mailbox and eventfd; the queue thread
 * commits it. The alternative, a lock around the SQ shared with Python's thread, would
 * make the ring multi-issuer and run the next request's task work (the kernel copying it
 * into the entry) on whichever thread committed last: the trio thread, on the other CPU.
 * The hand-over costs a miss one eventfd wake (~5 us) on a path that takes milliseconds;
 * hits never touch the lock. */

static pthread_mutex_t ring_engines_lock = PTHREAD_MUTEX_INITIALIZER;
static struct fe_engine *ring_engines[FE_URING_SLOTS]; /* protected by ring_engines_lock */

int ring_token(const struct fe_uent *ent)
{
    const struct fe_uqueue *q = ent->q;
    return -(1 + ((q->e->ring_slot * FE_URING_MAX_Q + q->qid) * FE_URING_MAX_ENTS + ent->idx));
}

/* Copy a reply into ``ent``: header (out_header) and payload (iov[1..n)), bounded by the
 * payload buffer (a reply that does not fit answers EIO, never writes past it). */
static void ring_fill(struct fe_uent *ent, uint64_t unique, int err, const struct iovec *iov,
                      int n, struct fe_counters *c)
{
    size_t len = 0, room = ent->q->payload_len;
    for (int i = 1; i < n && !err; i++) {
        if (iov[i].iov_len > room - len) {
            err = EIO;
            break;
        }
        len += iov[i].iov_len;
    }
    if (err) {
        len = 0;
    } else if (len) {
        uint64_t t0 = c ? fe_now_ns() : 0; /* what the copy costs (a writev has none) */
        size_t at = 0;
        for (int i = 1; i < n; i++) {
            memcpy(ent->payload + at, iov[i].iov_base, iov[i].iov_len);
            at += iov[i].iov_len;
        }
        if (c) {
            c->ring_copy_ns += fe_now_ns() - t0;
            c->ring_copy_bytes += len;
        }
    }
    struct fuse_out_header oh = {.len = (uint32_t)(sizeof oh + len),
                                 .error = -err,
                                 .unique = unique};
    memcpy(ent->hdr->in_out, &oh, sizeof oh);
    ent->hdr->ring_ent_in_out.payload_sz = (uint32_t)len;
}

/* An SQE of ``q``'s ring (submitting what is queued when the SQ is full). */
static struct io_uring_sqe *ring_sqe(struct fe_uqueue *q)
{
    struct io_uring_sqe *sqe = io_uring_get_sqe(&q->ring);
    while (!sqe) {
        io_uring_submit(&q->ring);
        sqe = io_uring_get_sqe(&q->ring);
    }
    return sqe;
}

/* Queue one FUSE uring command for ``ent`` (REGISTER, or COMMIT_AND_FETCH of its request). */
static void ring_cmd(struct fe_uqueue *q, struct fe_uent *ent, uint32_t op)
{
    struct io_uring_sqe *sqe = ring_sqe(q);
    memset(sqe, 0, 128); /* an SQE128: the 80-byte command area too */
    sqe->opcode = IORING_OP_URING_CMD;
    sqe->fd = q->e->fd;
    sqe->cmd_op = op;
    if (op == FE_IO_URING_CMD_REGISTER) {
        sqe->addr = (uint64_t)(uintptr_t)ent->iov;
        sqe->len = 2;
    }
    struct fe_uring_cmd_req req = {.qid = (uint16_t)q->qid,
                                   .commit_id = op == FE_IO_URING_CMD_REGISTER ? 0
                                                                               : ent->unique};
    memcpy(sqe->cmd, &req, sizeof req);
    io_uring_sqe_set_data(sqe, ent);
    atomic_store(&ent->state, ENT_KERNEL);
}

/* The queue thread answers the request in hand (``w->ent``): fill, then commit. */
int ring_answer(struct fe_worker *w, uint64_t unique, int err, struct iovec *iov, int n)
{
    struct fe_uent *ent = w->ent;
    ring_fill(ent, unique, err, iov, n, &w->c);
    ring_cmd(ent->q, ent, FE_IO_URING_CMD_COMMIT_AND_FETCH);
    w->ent = NULL; /* answered: nothing more goes into it */
    return 0;
}

/* Python's reply to a ring request (any thread): fill the entry, hand it to its queue. */
int ring_reply(int token, uint64_t unique, int err, struct iovec *iov, int n)
{
    long t = -(long)token - 1;
    int idx = (int)(t % FE_URING_MAX_ENTS),
        qid = (int)(t / FE_URING_MAX_ENTS % FE_URING_MAX_Q);
    long slot = t / FE_URING_MAX_ENTS / FE_URING_MAX_Q;
    int rc = -ENOENT;
    pthread_mutex_lock(&ring_engines_lock);
    struct fe_engine *e = slot >= 0 && slot < FE_URING_SLOTS ? ring_engines[slot] : NULL;
    if (e && qid < e->nqueues && idx < e->nents) {
        struct fe_uqueue *q = &e->queues[qid];
        struct fe_uent *ent = &q->ents[idx];
        pthread_mutex_lock(&q->mlock);
        if (!q->closed && atomic_load(&ent->state) == ENT_PY && ent->unique == unique) {
            ring_fill(ent, unique, err, iov, n, NULL);
            atomic_store(&ent->state, ENT_COMMIT);
            q->mail[q->nmail++] = (uint16_t)idx; /* at most once per entry: fits */
            uint64_t one = 1;
            ssize_t wr = write(q->efd, &one, sizeof one);
            (void)wr; /* EAGAIN: already signalled */
            rc = 0;
        }
        pthread_mutex_unlock(&q->mlock);
    }
    pthread_mutex_unlock(&ring_engines_lock);
    return rc;
}

/* A request arrived in ``ent``: lay it out as /dev/fuse would (fe_ring_layout: header,
 * op_in, payload, bounds-checked) in the worker's buffer, and dispatch it. Every ring request gets an
 * answer: one that dispatch leaves unanswered (no such opcode reaches a ring) gets EIO,
 * so no entry is ever lost. */
long fe_ring_layout(const struct fe_uring_req_header *hdr, const uint8_t *payload,
                    size_t payload_cap, uint8_t *out, size_t cap)
{
    struct fuse_in_header ih;
    memcpy(&ih, hdr->in_out, sizeof ih);
    size_t total = ih.len, psz = hdr->ring_ent_in_out.payload_sz;
    if (total < sizeof ih || total > cap || psz > payload_cap || psz > total - sizeof ih ||
        total - sizeof ih - psz > FE_URING_OP_IN_OUT_SZ)
        return -EIO;
    size_t oplen = total - sizeof ih - psz;
    memcpy(out, &ih, sizeof ih);
    memcpy(out + sizeof ih, hdr->op_in, oplen);
    memcpy(out + sizeof ih + oplen, payload, psz);
    return (long)total;
}

static void ring_request(struct fe_uqueue *q, struct fe_uent *ent)
{
    struct fe_worker *w = &q->w;
    struct fe_uring_ent_in_out io = ent->hdr->ring_ent_in_out;
    ent->unique = io.commit_id;
    atomic_store(&ent->state, ENT_C);
    w->ent = ent;
    w->c.ring_requests++;
    long total = fe_ring_layout(ent->hdr, ent->payload, q->payload_len, w->in, FE_REQ_BUF);
    if (total < 0) {
        ring_answer(w, io.commit_id, EIO, NULL, 1);
        return;
    }
    dispatch(w, w->in, (size_t)total);
    if (w->ent && atomic_load(&ent->state) == ENT_C)
        ring_answer(w, io.commit_id, EIO, NULL, 1);
    w->ent = NULL;
}

/* Python's commits waiting in the mailbox. */
static void ring_drain_mail(struct fe_uqueue *q)
{
    uint16_t mail[FE_URING_MAX_ENTS];
    pthread_mutex_lock(&q->mlock);
    int n = q->nmail;
    memcpy(mail, q->mail, (size_t)n * sizeof *mail);
    q->nmail = 0;
    pthread_mutex_unlock(&q->mlock);
    for (int i = 0; i < n; i++)
        ring_cmd(q, &q->ents[mail[i]], FE_IO_URING_CMD_COMMIT_AND_FETCH);
}

static void ring_arm_eventfd(struct fe_uqueue *q)
{
    struct io_uring_sqe *sqe = ring_sqe(q);
    io_uring_prep_read(sqe, q->efd, &q->efd_val, sizeof q->efd_val, 0);
    io_uring_sqe_set_data(sqe, NULL);
}

static void ring_report(struct fe_uqueue *q, int registered)
{
    struct fe_engine *e = q->e;
    pthread_mutex_lock(&e->rlock);
    q->registered = registered;
    e->nreported++;
    pthread_cond_broadcast(&e->rcond);
    pthread_mutex_unlock(&e->rlock);
}

/* Set up the ring on this thread (single issuer, task work deferred to our waits: the
 * kernel copies a request into an entry when this thread asks for completions, on this
 * CPU), register every entry; then serve CQEs until the connection or the engine ends. */
static void *queue_main(void *arg)
{
    struct fe_uqueue *q = arg;
    struct fe_engine *e = q->e;
    pthread_setname_np(pthread_self(), "ks-fuse-uring"); /* top -H, bench: by role */
    cpu_set_t cpus;
    CPU_ZERO(&cpus);
    CPU_SET(q->qid, &cpus);
    pthread_setaffinity_np(pthread_self(), sizeof cpus, &cpus); /* offline CPU: unpinned */
    struct io_uring_params p = {.flags = IORING_SETUP_SQE128 | IORING_SETUP_SINGLE_ISSUER |
                                         IORING_SETUP_DEFER_TASKRUN};
    unsigned depth = (unsigned)e->nents * 2 + 2;
    int rc = io_uring_queue_init_params(depth, &q->ring, &p);
    if (rc == -EINVAL) { /* a kernel without DEFER_TASKRUN */
        struct io_uring_params plain = {.flags = IORING_SETUP_SQE128};
        rc = io_uring_queue_init_params(depth, &q->ring, &plain);
    }
    if (rc < 0) {
        ring_report(q, rc);
        goto out;
    }
    q->ring_up = 1;
    for (int i = 0; i < e->nents; i++)
        ring_cmd(q, &q->ents[i], FE_IO_URING_CMD_REGISTER);
    ring_arm_eventfd(q);
    rc = io_uring_submit(&q->ring);
    /* A REGISTER the kernel refuses completes at once; an accepted one completes only
     * with a request. So: refused iff a CQE is already there with an error. */
    int registered = rc < 0 ? rc : 1;
    struct io_uring_cqe *cqe;
    unsigned head, seen = 0;
    io_uring_for_each_cqe(&q->ring, head, cqe) {
        struct fe_uent *ent = io_uring_cqe_get_data(cqe);
        if (ent && cqe->res < 0) {
            atomic_store(&ent->state, ENT_DEAD);
            registered = cqe->res;
            seen++;
        } else {
            break; /* a request already: handled below */
        }
    }
    io_uring_cq_advance(&q->ring, seen);
    ring_report(q, registered);
    if (registered < 0)
        goto out;
    for (;;) {
        rc = io_uring_submit_and_wait(&q->ring, 1);
        if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY)
            break;
        int stop = 0, gone = 0;
        seen = 0;
        io_uring_for_each_cqe(&q->ring, head, cqe) {
            struct fe_uent *ent = io_uring_cqe_get_data(cqe);
            int res = cqe->res;
            seen++;
            if (!ent) { /* the eventfd: Python's commits, or stop */
                ring_drain_mail(q);
                if (atomic_load(&e->ring_stop))
                    stop = 1;
                else
                    ring_arm_eventfd(q);
            } else if (res == 0) {
                ring_request(q, ent);
            } else { /* ENOTCONN/ECONNABORTED: the connection is gone */
                atomic_store(&ent->state, ENT_DEAD);
                if (res == -ENOTCONN || res == -ECONNABORTED || res == -ECANCELED)
                    gone = 1;
                else
                    q->w.c.ring_lost++; /* a refused commit: that entry serves no more */
            }
        }
        io_uring_cq_advance(&q->ring, seen);
        if (stop || gone)
            break;
    }
out:
    pthread_mutex_lock(&q->mlock);
    q->closed = 1; /* Python's late replies: -ENOENT from now */
    pthread_mutex_unlock(&q->mlock);
    if (atomic_fetch_sub(&e->live, 1) == 1)
        wake(e);
    return NULL;
}

/* The possible CPUs (the kernel makes one queue per possible CPU, qid = its number). */
static int possible_cpus(void)
{
    FILE *f = fopen("/sys/devices/system/cpu/possible", "re");
    int n = 0;
    if (f) {
        unsigned a, b;
        char sep;
        while (fscanf(f, "%u", &a) == 1) {
            b = a;
            if (fscanf(f, "%c", &sep) == 1 && sep == '-' && fscanf(f, "%u%c", &b, &sep) < 1)
                break;
            if (b >= a && b < FE_URING_MAX_Q)
                n = (int)b + 1 > n ? (int)b + 1 : n;
            if (sep != ',')
                break;
        }
        fclose(f);
    }
    return n;
}

void ring_signal_stop(struct fe_engine *e)
{
    atomic_store(&e->ring_stop, 1);
    for (int i = 0; i < e->nqueues; i++) {
        uint64_t one = 1;
        ssize_t wr = write(e->queues[i].efd, &one, sizeof one);
        (void)wr;
    }
}

/* Start the queues and wait (bounded) for their registrations: 1 if every queue is
 * registered (the kernel's ring is ready: requests go through it), else 0 (the kernel
 * turned io_uring off for the connection at the first refused REGISTER; /dev/fuse
 * serves, and the queues that did register stay idle until the end). */
int ring_start(struct fe_engine *e, char *err, size_t errlen)
{
    int ncpu = possible_cpus();
    uint32_t depth = e->opt.uring_depth ? e->opt.uring_depth : FE_URING_DEPTH;
    if (ncpu < 1 || depth > FE_URING_MAX_ENTS) {
        set_err(err, errlen, "io_uring: %d possible CPUs, %u entries", ncpu, depth);
        return -EINVAL;
    }
    pthread_mutex_lock(&ring_engines_lock);
    for (int s = 0; s < FE_URING_SLOTS && e->ring_slot < 0; s++)
        if (!ring_engines[s]) {
            ring_engines[s] = e;
            e->ring_slot = s;
        }
    pthread_mutex_unlock(&ring_engines_lock);
    e->queues = calloc((size_t)ncpu, sizeof *e->queues);
    if (e->ring_slot < 0 || !e->queues) {
        set_err(err, errlen, "io_uring: %s", e->queues ? "too many engines" : "out of memory");
        return -ENOMEM;
    }
    e->nents = (int)depth;
    /* the kernel's minimum: max(FUSE_MIN_READ_BUFFER, max_write, max_pages pages) */
    size_t payload = reply_room(e);
    if (payload < FE_MAX_WRITE)
        payload = FE_MAX_WRITE;
    if (payload < FE_FUSE_MIN_READ_BUFFER)
        payload = FE_FUSE_MIN_READ_BUFFER;
    for (int i = 0; i < ncpu; i++) {
        struct fe_uqueue *q = &e->queues[i];
        q->e = e;
        q->qid = i;
        q->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        pthread_mutex_init(&q->mlock, NULL);
        q->payload_len = payload;
        q->map_len = payload * (size_t)depth;
        q->payloads = mmap(NULL, q->map_len, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        q->ents = calloc(depth, sizeof *q->ents);
        q->mail = calloc(depth, sizeof *q->mail);
        int bufs = worker_buffers(&q->w, e, e->fd);
        e->nqueues = i + 1;
        if (q->efd < 0 || q->payloads == MAP_FAILED || !q->ents || !q->mail || bufs < 0) {
            if (q->payloads == MAP_FAILED)
                q->payloads = NULL;
            set_err(err, errlen, "io_uring queue %d: out of memory", i);
            return -ENOMEM;
        }
        for (uint32_t k = 0; k < depth; k++) {
            struct fe_uent *ent = &q->ents[k];
            ent->q = q;
            ent->idx = (uint16_t)k;
            ent->hdr = calloc(1, sizeof *ent->hdr);
            if (!ent->hdr) {
                set_err(err, errlen, "io_uring queue %d: out of memory", i);
                return -ENOMEM;
            }
            ent->payload = q->payloads + (size_t)k * payload;
            ent->iov[0] = (struct iovec){ent->hdr, sizeof *ent->hdr};
            ent->iov[1] = (struct iovec){ent->payload, payload};
        }
    }
    for (int i = 0; i < e->nqueues; i++) {
        struct fe_uqueue *q = &e->queues[i];
        atomic_fetch_add(&e->live, 1);
        if (pthread_create(&q->thread, NULL, queue_main, q) != 0) {
            atomic_fetch_sub(&e->live, 1);
            ring_report(q, -EAGAIN);
            continue;
        }
        q->started = 1;
    }
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 5;
    int ok = 1;
    pthread_mutex_lock(&e->rlock);
    while (e->nreported < e->nqueues)
        if (pthread_cond_timedwait(&e->rcond, &e->rlock, &until) == ETIMEDOUT)
            break;
    for (int i = 0; i < e->nqueues; i++)
        if (e->queues[i].registered != 1) {
            if (ok)
                set_err(err, errlen, "io_uring queue %d: %s", i,
                        e->queues[i].registered < 0 ? strerror(-e->queues[i].registered)
                                                    : "no report in 5 s");
            ok = 0;
        }
    pthread_mutex_unlock(&e->rlock);
    return ok;
}

void ring_join(struct fe_engine *e)
{
    for (int i = 0; i < e->nqueues; i++)
        if (e->queues[i].started) {
            pthread_join(e->queues[i].thread, NULL);
            e->queues[i].started = 0;
        }
}

/* After the queue threads are joined: their rings (closing one cancels what the kernel
 * still holds of it), buffers and the token slot. */
void ring_free(struct fe_engine *e)
{
    pthread_mutex_lock(&ring_engines_lock);
    if (e->ring_slot >= 0)
        ring_engines[e->ring_slot] = NULL;
    e->ring_slot = -1;
    pthread_mutex_unlock(&ring_engines_lock);
    for (int i = 0; i < e->nqueues; i++) {
        struct fe_uqueue *q = &e->queues[i];
        if (q->ring_up)
            io_uring_queue_exit(&q->ring);
        if (q->ents)
            for (int k = 0; k < e->nents; k++)
                free(q->ents[k].hdr);
        free(q->ents);
        free(q->mail);
        free(q->w.in);
        free(q->w.out);
        if (q->payloads)
            munmap(q->payloads, q->map_len);
        if (q->efd >= 0)
            close(q->efd);
        pthread_mutex_destroy(&q->mlock);
    }
    free(e->queues);
    e->queues = NULL;
    e->nqueues = 0;
}

int fe_transport(const struct fe_engine *e, const char **why)
{
    if (why)
        *why = e->ring_why;
    return e->transport;
}

/* Before offering io_uring at INIT: can this process make a ring with 128-byte SQEs at
 * all (io_uring_disabled, seccomp, memlock)? Once INIT negotiated it, the kernel holds
 * every request until the ring is ready, so a failure must come before, not after. */
int ring_probe(void)
{
    struct io_uring ring;
    if (io_uring_queue_init(4, &ring, IORING_SETUP_SQE128) < 0)
        return 0;
    io_uring_queue_exit(&ring);
    return 1;
}

/* After a failed ring_start: a REGISTER the kernel refuses (qid out of range) turns
 * io_uring off for the connection and wakes the requests it held (fuse_uring_cmd sets
 * fc->io_uring = 0), so /dev/fuse serves them. A queue's own refused REGISTER did that
 * already; this covers the failures before any reached the kernel. */
void ring_refuse(struct fe_engine *e)
{
    struct io_uring ring;
    if (io_uring_queue_init(4, &ring, IORING_SETUP_SQE128) < 0)
        return;
    struct fe_uring_req_header hdr;
    struct iovec iov[2] = {{&hdr, sizeof hdr}, {&hdr, sizeof hdr}};
    struct io_uring_sqe *sqe = io_uring_get_sqe(&ring);
    if (!sqe) { /* a new ring of 4 has room: never */
        io_uring_queue_exit(&ring);
        return;
    }
    memset(sqe, 0, 128);
    sqe->opcode = IORING_OP_URING_CMD;
    sqe->fd = e->fd;
    sqe->cmd_op = FE_IO_URING_CMD_REGISTER;
    sqe->addr = (uint64_t)(uintptr_t)iov;
    sqe->len = 2;
    struct fe_uring_cmd_req req = {.qid = UINT16_MAX};
    memcpy(sqe->cmd, &req, sizeof req);
    io_uring_submit(&ring);
    struct io_uring_cqe *cqe;
    if (io_uring_wait_cqe(&ring, &cqe) == 0)
        io_uring_cqe_seen(&ring, cqe);
    io_uring_queue_exit(&ring);
}
