/* fuse_threads.c — the request threads: a /dev/fuse fd each (cloned, or handed in on a
 * resume), the solo gate and crowd rule that decide how many of them read, and their
 * start, hand-over (fe_stop) and join. */
#define _GNU_SOURCE
#include "fuse_engine_i.h"

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <time.h>
#include <unistd.h>

#ifndef FUSE_DEV_IOC_CLONE
#define FUSE_DEV_IOC_CLONE _IOR(229, 0, uint32_t)
#endif

/* The solo gate.  One task reading one file sequentially (dd, fio's one psync job, a
 * loader with one worker) sends the kernel's readahead as bursts of four 1 MiB READs;
 * with two threads in read(2) the kernel wakes both, and the second, woken on the
 * reader's CPU, preempted the reader, which then copied its pages only after every READ
 * of the burst was answered, while the other CPU idled (one thread pipelines as a
 * single-threaded daemon does).  But a task waiting on each request in turn (random 4 KiB
 * READs, stat, ls) is served fastest by a thread woken on its own, now idle, CPU: one
 * thread costs it a cross-CPU wake-up per request.  So the threads after the first
 * wait here while, for FE_SOLO_NS, every request was a READ of FE_SOLO_READ or more
 * from one task (readahead); any other request, or another task's, opens the gate. */

/* The crowd rule.  More tasks than CPUs, each sending short requests in turn (8 workers
 * opening and reading ImageNet-like files on 2 CPUs): no CPU is idle for a second
 * thread, and each request that woke it from read(2) cost a sleep and a wake-up, more
 * CPU per file than one thread answering them all.  So while, over the last FE_SOLO_NS,
 * more tasks than CPUs sent requests averaging under FE_CROWD_SHORT_NS that one thread
 * could have answered alone (all threads' time in dispatch under FE_CROWD_BUSY_PCT of the window),
 * the gate stays as it is (closed, once its last opening ran out). Long requests
 * (sequential readers' 1 MiB READs) or a busy thread (a large machine's crowd) leave it to
 * the solo gate's own reasons. The measurements behind both rules: docs/design.md, "The
 * solo gate and the crowd rule". */

/* After each /dev/fuse request (arrived ``t0``) of task ``pid``: count it, and judge the
 * window that ended (one thread, by CAS on crowd_since). One shared write per task and
 * window; the rest are this thread's own totals. */
void crowd_note(struct fe_worker *w, uint32_t pid, uint64_t t0)
{
    struct fe_engine *e = w->e;
    if (e->nworkers < 2)
        return;
    uint64_t now = fe_now_ns();
    atomic_store_explicit(&w->busy_ns,
                          atomic_load_explicit(&w->busy_ns, memory_order_relaxed) + (now - t0),
                          memory_order_relaxed);
    atomic_store_explicit(&w->requests,
                          atomic_load_explicit(&w->requests, memory_order_relaxed) + 1,
                          memory_order_relaxed);
    uint64_t bit = 1ull << (pid % 64);
    if (pid && !(atomic_load_explicit(&e->crowd_tasks, memory_order_relaxed) & bit))
        atomic_fetch_or_explicit(&e->crowd_tasks, bit, memory_order_relaxed);
    uint64_t since = atomic_load_explicit(&e->crowd_since, memory_order_relaxed);
    if (now - since < FE_SOLO_NS ||
        !atomic_compare_exchange_strong(&e->crowd_since, &since, now))
        return;
    uint64_t busy = 0, requests = 0;
    for (int i = 0; i < e->nworkers; i++) {
        busy += atomic_load_explicit(&e->workers[i].busy_ns, memory_order_relaxed);
        requests += atomic_load_explicit(&e->workers[i].requests, memory_order_relaxed);
    }
    uint64_t db = busy - e->crowd_busy, dr = requests - e->crowd_requests;
    e->crowd_busy = busy;
    e->crowd_requests = requests;
    int tasks = __builtin_popcountll(atomic_exchange(&e->crowd_tasks, 0));
    int crowded = tasks > e->ncpu && dr && db / dr < FE_CROWD_SHORT_NS &&
                  db < (now - since) / 100 * FE_CROWD_BUSY_PCT;
    if (crowded && !atomic_exchange(&e->crowded, 1))
        w->c.gate_crowded++;
    else if (!crowded)
        atomic_store(&e->crowded, 0);
}

/* The solo gate's bookkeeping (solo_gate, below), on every /dev/fuse request, at its
 * arrival ``now``: while the gate was opened within the last quarter of FE_SOLO_NS it
 * touches nothing shared (fio's random 4 KiB j4 is ~0.5 us per READ). */
void solo_note(struct fe_worker *w, const struct fuse_in_header *h, size_t n, uint64_t now)
{
    struct fe_engine *e = w->e;
    if (e->nworkers < 2 || !h->pid)
        return; /* (the kernel's own requests carry no task) */
    if (atomic_load_explicit(&e->crowded, memory_order_relaxed))
        return; /* the crowd rule: the gate stays as it is */
    if (atomic_load_explicit(&e->multi_until, memory_order_relaxed) > now + FE_SOLO_NS / 4 * 3)
        return;
    uint32_t prev = atomic_load_explicit(&e->last_pid, memory_order_relaxed);
    if (prev != h->pid)
        atomic_store_explicit(&e->last_pid, h->pid, memory_order_relaxed);
    const struct fuse_read_in *in = (const void *)(h + 1);
    if (prev == h->pid && h->opcode == FUSE_READ && n >= sizeof *h + sizeof *in &&
        in->size >= FE_SOLO_READ)
        return; /* readahead of the one task reading */
    if (atomic_exchange(&e->multi_until, now + FE_SOLO_NS) <= now) {
        if (prev != h->pid)
            w->c.gate_opened_tasks++;
        else
            w->c.gate_opened_requests++;
        pthread_mutex_lock(&e->slock);
        pthread_cond_broadcast(&e->scond);
        pthread_mutex_unlock(&e->slock);
    }
}

/* A request thread's buffers (a /dev/fuse reader's or an io_uring queue's): one request
 * in, and READDIR replies out, of max_pages pages (32, the kernel's default, before INIT
 * negotiated more). 0, or -ENOMEM (the caller frees what was allocated). */
size_t reply_room(const struct fe_engine *e)
{
    return (size_t)(e->max_pages ? e->max_pages : 32) * 4096;
}

int worker_buffers(struct fe_worker *w, struct fe_engine *e, int fd)
{
    w->e = e;
    w->fd = fd;
    w->outlen = reply_room(e);
    w->in = malloc(FE_REQ_BUF);
    w->out = malloc(w->outlen);
    return w->in && w->out ? 0 : -ENOMEM;
}

/* The solo gate (its reasons above solo_note): a thread after the first waits here
 * until the gate is open, the engine stops, or a reader has left. */
static void solo_gate(struct fe_engine *e, struct fe_worker *w)
{
    if (w == &e->workers[0])
        return;
    pthread_mutex_lock(&e->slock);
    for (int waited = 0; !atomic_load(&e->stopping) && !atomic_load(&e->gate_open) &&
                         fe_now_ns() >= atomic_load(&e->multi_until);
         waited = 1) {
        if (!waited)
            w->c.gate_waits++;
        struct timespec t;
        clock_gettime(CLOCK_REALTIME, &t);
        t.tv_nsec += 100000000; /* (stopping and gate_open also broadcast) */
        if (t.tv_nsec >= 1000000000) {
            t.tv_sec++;
            t.tv_nsec -= 1000000000;
        }
        pthread_cond_timedwait(&e->scond, &e->slock, &t);
    }
    pthread_mutex_unlock(&e->slock);
}

static void solo_release(struct fe_engine *e)
{
    pthread_mutex_lock(&e->slock);
    atomic_store(&e->gate_open, 1);
    pthread_cond_broadcast(&e->scond);
    pthread_mutex_unlock(&e->slock);
}

static void *worker_main(void *arg)
{
    struct fe_worker *w = arg;
    struct fe_engine *e = w->e;
    pthread_setname_np(pthread_self(), "ks-fuse"); /* top -H, bench: by role */
    fe_reply_thread(e);
    for (;;) {
        solo_gate(e, w);
        if (atomic_load(&e->stopping))
            break; /* fe_stop: a successor reads the connection now */
        ssize_t n = read(w->fd, w->in, FE_REQ_BUF);
        if (n == 0)
            break; /* not /dev/fuse (the fuzzer's socket): its end */
        if (n < 0) {
            if (errno == EINTR || errno == EAGAIN || errno == ENOENT)
                continue; /* ENOENT: a request interrupted before we read it */
            break;        /* ENODEV: unmounted or aborted */
        }
        dispatch(w, w->in, (size_t)n);
    }
    solo_release(e); /* the others read on, and find the same end */
    atomic_store(&w->done, 1);
    if (atomic_fetch_sub(&e->dev_live, 1) == 1 && e->nqueues)
        ring_signal_stop(e); /* the connection is gone (or handed over): so are the rings */
    if (atomic_fetch_sub(&e->live, 1) == 1)
        wake(e); /* the last one out tells Python */
    return NULL;
}

static void on_stop_signal(int sig) { (void)sig; } /* only to interrupt read(2) */

static void install_stop_signal(void)
{
    struct sigaction sa = {0};
    sa.sa_handler = on_stop_signal; /* no SA_RESTART: read returns EINTR */
    sigemptyset(&sa.sa_mask);
    sigaction(SIGUSR2, &sa, NULL);
}

int fe_stop(struct fe_engine *e)
{
    if (e->transport)
        return -EBUSY; /* ring entries cannot change hands (fe_transport) */
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, install_stop_signal);
    atomic_store(&e->stopping, 1);
    solo_release(e);
    /* a thread between its check and read(2) misses one signal: send until all are out */
    for (int round = 0; atomic_load(&e->live) > 0 && round < 5000; round++) {
        for (int i = 0; i < e->nworkers; i++)
            if (e->workers[i].started && !atomic_load(&e->workers[i].done))
                pthread_kill(e->workers[i].thread, SIGUSR2);
        usleep(1000);
    }
    fe_join(e);
    return 0;
}

static int clone_fd(int master)
{
    int fd = open("/dev/fuse", O_RDWR | O_CLOEXEC);
    if (fd < 0)
        return -1;
    uint32_t m = (uint32_t)master;
    if (ioctl(fd, FUSE_DEV_IOC_CLONE, &m) < 0) {
        int saved = errno;
        close(fd);
        errno = saved;
        return -1;
    }
    return fd;
}

int fe_give_fds(struct fe_engine *e, const int *fds, int n)
{
    if (n < 1 || n > FE_MAX_THREADS || fds[0] != e->fd || e->workers)
        return -EINVAL;
    memcpy(e->given, fds, (size_t)n * sizeof *fds);
    e->ngiven = n;
    return 0;
}

int fe_fds(const struct fe_engine *e, int *out, int max)
{
    int n = 0;
    for (int i = 0; i < e->nworkers && n < max; i++)
        out[n++] = e->workers[i].fd;
    return n;
}
int fe_start(struct fe_engine *e, int nthreads, char *err, size_t errlen)
{
    if (nthreads < e->ngiven)
        nthreads = e->ngiven; /* every handed-in fd is read (its requests too) */
    if (nthreads < 1)
        nthreads = 1;
    if (nthreads > FE_MAX_THREADS)
        nthreads = FE_MAX_THREADS;
    e->workers = calloc((size_t)nthreads, sizeof *e->workers);
    if (!e->workers)
        return -ENOMEM;
    cpu_set_t cpus; /* the crowd rule's CPUs */
    e->ncpu = sched_getaffinity(0, sizeof cpus, &cpus) == 0 ? CPU_COUNT(&cpus) : 1;
    for (int i = 0; i < nthreads; i++) {
        struct fe_worker *w = &e->workers[i];
        int bufs = worker_buffers(w, e,
                                  i == 0          ? e->fd
                                  : i < e->ngiven ? e->given[i]
                                                  : clone_fd(e->fd));
        if (w->fd < 0 || bufs < 0) {
            set_err(err, errlen, "thread %d: %s", i,
                    w->fd < 0 ? strerror(errno) : "out of memory");
            if (i && w->fd >= 0)
                close(w->fd);
            free(w->in);
            free(w->out);
            w->in = w->out = NULL;
            break;
        }
        e->nworkers = i + 1;
    }
    if (e->nworkers < nthreads && e->nworkers == 0)
        return -EIO;
    atomic_store(&e->live, e->nworkers);
    atomic_store(&e->dev_live, e->nworkers);
    for (int i = 0; i < e->nworkers; i++) {
        struct fe_worker *w = &e->workers[i];
        if (pthread_create(&w->thread, NULL, worker_main, w) != 0) {
            atomic_fetch_sub(&e->live, 1);
            atomic_fetch_sub(&e->dev_live, 1);
            continue;
        }
        w->started = 1;
    }
    /* The /dev/fuse readers first: they serve the requests the kernel sends before the
     * ring is ready (none: it holds them), FORGETs and INTERRUPTs, and everything after
     * a refused REGISTER. */
    if (e->uring) {
        e->transport = ring_start(e, e->ring_why, sizeof e->ring_why) == 1;
        if (!e->transport) { /* not fatal: /dev/fuse serves (fe_transport says why) */
            ring_refuse(e);
            e->flags &= ~FE_FUSE_OVER_IO_URING; /* the kernel turned it off: a successor
                                                     * adopts a /dev/fuse connection */
        }
    }
    return 0;
}

void fe_join(struct fe_engine *e)
{
    for (int i = 0; i < e->nworkers; i++)
        if (e->workers[i].started) {
            pthread_join(e->workers[i].thread, NULL);
            e->workers[i].started = 0;
        }
    ring_join(e); /* the last /dev/fuse reader out stopped them */
}
