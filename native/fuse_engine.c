/* fuse_engine.c — the native FUSE data plane (fuse_engine.h says what and why).
 *
 * Map of this file, top to bottom:
 *   mount            fe_mount / fe_unmount: mount(2) with a /dev/fuse fd (root)
 *   tier             fe_tier_*: the table of fuse_tier.c (verified buffers by key), for Python
 *   replies          reply_iov and friends: one writev per reply, header + caller's buffers
 *                    (a large READ's by vmsplice + splice, fuse.splice)
 *   attributes       fill_attr / fill_entry from the index arrays (bounds-checked)
 *   handlers         one function per opcode; dispatch() picks one and counts it
 *   READ             stream bookkeeping (prefetch), then tier hit → writev, else queue
 *   queue            misses and xattrs for Python, an eventfd per engine
 *   io_uring         queues per CPU: register entries, serve CQEs, commit replies (Python's
 *                    through a mailbox the queue's thread drains)
 *   threads          fe_init (INIT), fe_start (clone a /dev/fuse fd per thread), fe_join
 *
 * Slot lifetime: a slot in the table holds one reference for the table; a READ that
 * replies from it takes one under its stripe lock and drops it after writev. Whoever
 * drops the last reference retires the slot: fe_tier_discard hands the owner straight
 * back (the binding releases the Python buffer), a request thread puts it on the dead
 * list that fe_tier_reap empties from Python. No buffer is released while a reply
 * still points into it, and the request threads never touch a Python object.
 */
#define _GNU_SOURCE
#include "fuse_engine.h"
#include "fuse_fetch.h"
#include "fuse_tier.h"
#include "fuse_uring_abi.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/fuse.h>
#include <liburing.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define FE_NOTIFY_RESEND 7 /* kernel 6.9+ (include/uapi/linux/fuse.h, 7.40) */

#ifndef FUSE_DEV_IOC_CLONE
#define FUSE_DEV_IOC_CLONE _IOR(229, 0, uint32_t)
#endif

#define FE_MAX_THREADS 256
#define FE_MAX_IOV 64
#define FE_MAX_WRITE (128 * 1024)
#define FE_REQ_BUF (FE_MAX_WRITE + 4096)

/* io_uring queues. 32 entries per queue: an entry stays with Python for a whole miss
 * (milliseconds), and a queue without a free entry parks every request of its CPU, hits
 * and metadata too, in the kernel until a commit; 32 per CPU is, on 2 CPUs, the default
 * max_background (64) of requests in flight. Each entry's payload is max_pages pages
 * (1 MiB), mapped lazily: 32 MiB of address space per CPU, resident as far as replies
 * touched it. */
#define FE_URING_DEPTH 32
#define FE_URING_MAX_Q 256 /* qids are CPU numbers */
#define FE_URING_MAX_ENTS 256
#define FE_URING_SLOTS 64 /* engines with rings per process (ring tokens) */

static void set_err(char *err, size_t errlen, const char *fmt, ...)
{
    if (!err || !errlen)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

/* ------------------------------------------------------------------------- mount */

int fe_mount(const char *path, const char *fsname, int allow_other, int nonempty,
             uint32_t max_read, char *err, size_t errlen)
{
    (void)nonempty; /* a fusermount rule; mount(2) itself mounts over anything */
    int fd = open("/dev/fuse", O_RDWR | O_CLOEXEC);
    if (fd < 0) {
        set_err(err, errlen, "open /dev/fuse: %s", strerror(errno));
        return -1;
    }
    char opts[256];
    int n = snprintf(opts, sizeof opts,
                     "fd=%d,rootmode=40000,user_id=%u,group_id=%u,default_permissions%s", fd,
                     (unsigned)getuid(), (unsigned)getgid(),
                     allow_other ? ",allow_other" : "");
    if (max_read)
        n += snprintf(opts + n, sizeof opts - (size_t)n, ",max_read=%u", max_read);
    if (mount(fsname, path, "fuse.kspeedfs", MS_RDONLY | MS_NOSUID | MS_NODEV, opts) < 0) {
        int saved = errno;
        set_err(err, errlen, "mount %s: %s", path, strerror(saved));
        close(fd);
        errno = saved;
        return -1;
    }
    return fd;
}

int fe_unmount(const char *path) { return umount2(path, MNT_DETACH) < 0 ? -errno : 0; }

/* -------------------------------------------------------------------- the engine */

struct fe_handle { /* one open file: the sequential-read state */
    uint64_t fh;   /* what the kernel holds: generation << 32 | slot + 1 */
    pthread_mutex_t lock;
    uint64_t next_offset;
    uint64_t run;
    int64_t prefetched_to;
};

struct fe_worker {
    struct fe_engine *e;
    pthread_t thread;
    int fd;
    int started;
    atomic_int done;
    uint8_t *in;  /* FE_REQ_BUF: one request */
    uint8_t *out; /* READDIR replies: max_pages pages */
    size_t outlen;
    struct fe_counters c;
    struct fe_uent *ent; /* the ring entry of the request in hand (NULL: /dev/fuse) */
    /* the crowd rule's totals (crowd_note): written by this thread only. Not the sums of
     * ``c.ns``/``c.count``: those stop before the reply is written (a 1 MiB READ's copy,
     * which makes it long) and leave out the requests queued for Python */
    _Atomic uint64_t busy_ns, requests;
};

/* A ring entry's life, in its ``state`` (the kernel's own FRRS_* states in brackets):
 *
 *   KERNEL ──CQE──► C ──answered in C──────────────────────► KERNEL (COMMIT_AND_FETCH)
 *   [AVAILABLE]     │                                         [USERSPACE → AVAILABLE]
 *                   └─queued for Python─► PY ──fe_reply_*──► COMMIT ──mailbox──► KERNEL
 *   any ──CQE < 0 (connection gone, ring cancelled)──► DEAD
 *
 * Only the queue's thread submits SQEs (the ring is single-issuer); Python's thread
 * fills an entry in PY and hands it over through the mailbox. */
enum { ENT_KERNEL, ENT_C, ENT_PY, ENT_COMMIT, ENT_DEAD };

struct fe_uent {
    struct fe_uqueue *q;
    struct fe_uring_req_header *hdr;
    uint8_t *payload;
    struct iovec iov[2]; /* what REGISTER hands the kernel */
    uint16_t idx;
    atomic_int state;
    uint64_t unique; /* the request it holds (C, PY, COMMIT) */
};

struct fe_uqueue {
    struct fe_engine *e;
    struct fe_worker w; /* dispatch's view: counters, buffers, ``ent`` */
    int qid;
    struct io_uring ring;
    int ring_up;
    pthread_t thread;
    int started;
    struct fe_uent *ents;
    uint8_t *payloads; /* one mapping: nents x payload_len */
    size_t payload_len, map_len;
    int efd; /* Python's commits (and the stop) wake the thread */
    uint64_t efd_val;
    pthread_mutex_t mlock; /* the mailbox: protects mail, nmail, closed */
    uint16_t *mail;
    int nmail;
    int closed;     /* the thread is gone: replies to its entries refused */
    int registered; /* 1: every REGISTER accepted; < 0: -errno */
};

struct fe_engine {
    int fd;
    int efd;
    struct fe_index ix;
    struct fe_options opt;
    atomic_uint_least64_t spliced, spliced_bytes; /* replies by splice, any thread's */
    uint32_t *nlink;
    uint32_t blksize;
    /* negotiated at INIT */
    uint32_t minor, max_pages, max_readahead;
    uint64_t flags;
    struct fe_tier *tier; /* the memory tier's buffers (fuse_tier.c) */
    /* open file handles: a slot table, so an fh is validated, never dereferenced (after
     * an upgrade the kernel sends the previous daemon's fhs: unknown here, no stream) */
    pthread_mutex_t hlock;
    struct fe_handle **hslots;
    uint32_t nhslots, hgen;
    /* fds handed in for the request threads (fe_give_fds) */
    int given[FE_MAX_THREADS];
    int ngiven;
    /* stopping for a successor (fe_stop) */
    atomic_int stopping;
    /* queue */
    pthread_mutex_t qlock;
    struct fe_request *q;
    size_t qhead, qlen, qcap;
    /* threads */
    struct fe_worker *workers;
    int nworkers;
    atomic_int live;
    atomic_int dev_live; /* of which /dev/fuse readers */
    /* the solo gate (solo_gate): requests from one task at a time are read by the first
     * /dev/fuse thread alone; the others read too while several tasks send */
    atomic_uint last_pid;         /* the task of the last request read */
    _Atomic uint64_t multi_until; /* fe_now_ns() before which every thread reads */
    atomic_int gate_open;         /* a reader left (unmount, stop): nobody waits any more */
    pthread_mutex_t slock;
    pthread_cond_t scond;
    /* the crowd rule (crowd_note): the last FE_SOLO_NS window's tasks, its requests'
     * time in dispatch (every /dev/fuse thread's) and their number, and its verdict */
    int ncpu;                            /* CPUs this process may run on (fe_start) */
    _Atomic uint64_t crowd_tasks;        /* bit pid % 64 of each task seen this window */
    _Atomic uint64_t crowd_since;        /* when this window began */
    uint64_t crowd_busy, crowd_requests; /* the totals when it began; its closer only */
    atomic_int crowded;
    /* io_uring queues (fe_start, when INIT negotiated FUSE_OVER_IO_URING) */
    int uring; /* negotiated */
    struct fe_uqueue *queues;
    int nqueues, nents;
    int ring_slot; /* in ring_engines[] (ring tokens), -1: none */
    atomic_int ring_stop;
    pthread_mutex_t rlock; /* the queues' registration reports */
    pthread_cond_t rcond;
    int nreported;
    int transport;      /* 1: every queue registered */
    char ring_why[160]; /* why not, when INIT negotiated it */
    /* the native chunk fetch (fuse_fetch.c): set once by fe_fetch_enable, freed by
     * fe_destroy (request threads may park on it until they are joined) */
    _Atomic(struct fe_fetch *) fetch;
    /* READs a parked list handed back and the tier answered (fe_read_again: the fetch
     * thread, or Python's thread in fetch_unpark): counted as hits, with their whole
     * latency, like a request thread's */
    pthread_mutex_t alock;
    struct fe_counters again; /* under alock */
};

static int is_dir(uint32_t mode) { return S_ISDIR(mode); }

struct fe_engine *fe_create(int fd, const struct fe_index *ix, const struct fe_options *opt,
                            char *err, size_t errlen)
{
    struct fe_engine *e = calloc(1, sizeof *e);
    if (!e) {
        set_err(err, errlen, "out of memory");
        return NULL;
    }
    e->fd = fd;
    e->ring_slot = -1;
    e->ix = *ix;
    e->opt = *opt;
    e->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    e->tier = tier_new();
    e->nlink = calloc(ix->entries ? ix->entries : 1, sizeof *e->nlink);
    if (e->efd < 0 || !e->tier || !e->nlink) {
        set_err(err, errlen, "engine setup: %s", strerror(errno ? errno : ENOMEM));
        e->fd = -1; /* still the caller's */
        fe_destroy(e);
        return NULL;
    }
    pthread_mutex_init(&e->qlock, NULL);
    pthread_mutex_init(&e->alock, NULL);
    pthread_mutex_init(&e->hlock, NULL);
    pthread_mutex_init(&e->rlock, NULL);
    pthread_cond_init(&e->rcond, NULL);
    pthread_mutex_init(&e->slock, NULL);
    pthread_cond_init(&e->scond, NULL);
    /* st_nlink of a directory: 2 + its subdirectories, once, not per GETATTR */
    for (uint64_t i = 0; i < ix->entries; i++)
        if (is_dir(ix->mode[i]))
            e->nlink[i] = 2;
    for (uint64_t i = 1; i < ix->entries; i++)
        if (is_dir(ix->mode[i]) && ix->parent[i] < ix->entries)
            e->nlink[ix->parent[i]]++;
    e->blksize = opt->blksize ? opt->blksize
                              : (uint32_t)(ix->block_size ? ix->block_size : ix->chunk_size);
    return e;
}

int fe_eventfd(const struct fe_engine *e) { return e->efd; }
int fe_running(const struct fe_engine *e) { return atomic_load(&e->live) > 0; }

void fe_negotiated(const struct fe_engine *e, uint32_t *minor, uint64_t *flags,
                   uint32_t *max_pages, uint32_t *max_readahead)
{
    *minor = e->minor;
    *flags = e->flags;
    *max_pages = e->max_pages;
    *max_readahead = e->max_readahead;
}

/* ---------------------------------------------------------- the tier, for Python */

int fe_tier_put(struct fe_engine *e, const uint8_t *key, size_t keylen, const void *data,
                size_t len, void *owner)
{
    return tier_put(e->tier, key, keylen, data, len, owner);
}

void *fe_tier_discard(struct fe_engine *e, const uint8_t *key, size_t keylen, int *found)
{
    return tier_discard(e->tier, key, keylen, found);
}

int fe_tier_touched(struct fe_engine *e, const uint8_t *key, size_t keylen, int bits)
{
    return tier_touched(e->tier, key, keylen, bits);
}

size_t fe_tier_reap(struct fe_engine *e, void **owners, size_t max)
{
    return tier_reap(e->tier, owners, max);
}

size_t fe_tier_clear(struct fe_engine *e, void **owners, size_t max)
{
    return tier_clear(e->tier, owners, max);
}

size_t fe_tier_count(struct fe_engine *e) { return tier_count(e->tier); }

/* ----------------------------------------------------------------------- replies */

/* Ring replies (the io_uring section defines them): Python's, by token, and the queue
 * thread's own for the request in hand. */
static int ring_reply(int token, uint64_t unique, int err, struct iovec *iov, int n);
static int ring_answer(struct fe_worker *w, uint64_t unique, int err, struct iovec *iov,
                       int n);
static int ring_token(const struct fe_uent *ent);

static int write_reply(int fd, struct iovec *iov, int n)
{
    for (;;) {
        ssize_t w = writev(fd, iov, n);
        if (w >= 0)
            return 0;
        if (errno != EINTR)
            return -errno; /* ENOENT: the request was interrupted; nothing to do */
    }
}

/* Replies by splice (fuse.splice). A writev hands the kernel our buffer, and it pins and
 * copies it a page at a time (fuse_copy_fill: a get-user-pages and the request's lock
 * around each page); vmsplice puts references to the same pages into a pipe (a batch of
 * pages per call) and splice(pipe → /dev/fuse) copies them into the page cache from
 * there: still one copy, and nothing waits in the pipe once splice returns, so a tier
 * buffer is never referenced after the reply that pinned it (fe_tier's slot rule holds).
 * Measured, the cluster's 4 sequential readers from peers (1 MiB READs, alternating
 * A/B, 2 rounds of 2): request threads 0.143-0.151 CPU-s/GB against 0.175 with writev,
 * the daemon without NIC threads 0.264-0.273 against 0.303-0.308, 2,350-2,480 MB/s
 * against 2,170-2,233. Below FE_SPLICE_MIN replies are written as before: for the
 * ImageNet-like files (~110 KB replies) splice saved nothing measurable (36 us per file
 * either way, warm; docs/design.md, "Replies by splice").
 *
 * A reply goes whole or not at all: its pages (the header's included) must fit the
 * pipe. A 1 MiB READ's reply spans 257 pages; a pipe beyond fs.pipe-max-size (1 MiB =
 * 256 pages by default) needs CAP_SYS_RESOURCE or the sysctl raised (./run setup does:
 * mount/sysctl-kspeedfs.conf), else such replies are written as before. Each thread that
 * replies for an engine with the option (request threads, the fetch thread) makes its
 * pipe on its first large reply; a failed splice closes it (whatever it held goes with
 * it) and the next reply makes another. */
#define FE_SPLICE_MIN (256 << 10)
#define FE_PIPE_WANT (2 << 20)

struct reply_pipe {
    int rd, wr;
    size_t pages; /* what it holds at most */
};

static pthread_key_t pipe_key;
static pthread_once_t pipe_once = PTHREAD_ONCE_INIT;
static __thread struct fe_engine *splice_for; /* this thread splices for it: counts */
static __thread struct reply_pipe *tpipe;     /* its pipe (also pipe_key's value) */

static void pipe_close(void *arg)
{
    struct reply_pipe *p = arg;
    close(p->rd);
    close(p->wr);
    free(p);
}

static void pipe_key_make(void) { (void)pthread_key_create(&pipe_key, pipe_close); }

/* A pipe as large as this process may make (FE_PIPE_WANT, else fs.pipe-max-size), or
 * NULL. */
static struct reply_pipe *pipe_open(void)
{
    int fd[2];
    if (pipe2(fd, O_CLOEXEC | O_NONBLOCK) < 0)
        return NULL;
    int got = fcntl(fd[1], F_SETPIPE_SZ, FE_PIPE_WANT);
    if (got < 0)
        got = fcntl(fd[1], F_SETPIPE_SZ, 1 << 20);
    if (got < 0)
        got = fcntl(fd[1], F_GETPIPE_SZ);
    struct reply_pipe *p = got > 0 ? malloc(sizeof *p) : NULL;
    if (!p) {
        close(fd[0]);
        close(fd[1]);
        return NULL;
    }
    *p = (struct reply_pipe){.rd = fd[0],
                             .wr = fd[1],
                             .pages = (size_t)got / (size_t)sysconf(_SC_PAGESIZE)};
    return p;
}

static void pipe_drop(void)
{
    pthread_setspecific(pipe_key, NULL);
    pipe_close(tpipe);
    tpipe = NULL;
}

size_t fe_splice_room(void)
{
    struct reply_pipe *p = pipe_open();
    if (!p)
        return 0;
    size_t room = (p->pages - 1) * (size_t)sysconf(_SC_PAGESIZE); /* a header's page */
    pipe_close(p);
    return room;
}

void fe_reply_thread(struct fe_engine *e) { splice_for = e->opt.splice ? e : NULL; }

/* ``iov[0..n)``, ``len`` bytes, spliced to ``fd``: 1 sent; 0 not (writev it: too small,
 * no pipe, more pages than the pipe holds, or vmsplice refused); -errno: splice failed
 * (ENOENT: the request was interrupted, as writev would say; any other error: the
 * caller writes the reply instead, and the kernel takes it or says ENOENT). */
static int splice_reply(int fd, const struct iovec *iov, int n, size_t len)
{
    struct fe_engine *e = splice_for;
    if (!e || len < FE_SPLICE_MIN)
        return 0;
    if (!tpipe) {
        pthread_once(&pipe_once, pipe_key_make);
        if (!(tpipe = pipe_open())) {
            splice_for = NULL; /* none now: none later (no fds, or no pipes) */
            return 0;
        }
        pthread_setspecific(pipe_key, tpipe);
    }
    size_t page = (size_t)sysconf(_SC_PAGESIZE), pages = 0;
    for (int i = 0; i < n; i++) {
        uintptr_t a = (uintptr_t)iov[i].iov_base;
        pages += (a + iov[i].iov_len + page - 1) / page - a / page;
    }
    if (pages > tpipe->pages)
        return 0;
    ssize_t v = vmsplice(tpipe->wr, iov, (unsigned long)n, SPLICE_F_NONBLOCK);
    if (v != (ssize_t)len) {
        pipe_drop(); /* part of it may be in the pipe */
        return 0;
    }
    ssize_t s;
    do /* EINTR: nothing was taken from the pipe */
        s = splice(tpipe->rd, NULL, fd, NULL, len, 0);
    while (s < 0 && errno == EINTR);
    if (s == (ssize_t)len) {
        atomic_fetch_add_explicit(&e->spliced, 1, memory_order_relaxed);
        atomic_fetch_add_explicit(&e->spliced_bytes, len, memory_order_relaxed);
        return 1;
    }
    int err = s < 0 ? errno : EIO;
    pipe_drop();
    return -err;
}

/* ``iov[0]`` is left for the header; the payload is iov[1..n). */
static int reply_iov(int fd, uint64_t unique, struct iovec *iov, int n)
{
    if (fd < 0)
        return ring_reply(fd, unique, 0, iov, n);
    struct fuse_out_header h = {.error = 0, .unique = unique};
    size_t len = sizeof h;
    for (int i = 1; i < n; i++)
        len += iov[i].iov_len;
    h.len = (uint32_t)len;
    iov[0].iov_base = &h;
    iov[0].iov_len = sizeof h;
    int spliced = splice_reply(fd, iov, n, len);
    if (spliced > 0 || spliced == -ENOENT)
        return spliced > 0 ? 0 : spliced;
    return write_reply(fd, iov, n); /* not spliced, or the splice failed */
}

static int reply_buf(int fd, uint64_t unique, const void *buf, size_t len)
{
    struct iovec iov[2] = {{0}, {(void *)buf, len}};
    return reply_iov(fd, unique, iov, len ? 2 : 1);
}

int fe_reply_error(int fd, uint64_t unique, int err)
{
    if (fd < 0)
        return ring_reply(fd, unique, err, NULL, 1);
    struct fuse_out_header h = {.len = sizeof h, .error = -err, .unique = unique};
    struct iovec iov = {&h, sizeof h};
    return write_reply(fd, &iov, 1);
}

int fe_reply_data(int fd, uint64_t unique, const void *buf, size_t len)
{
    return reply_buf(fd, unique, buf, len);
}

int fe_reply_iov(int fd, uint64_t unique, const void *const *bufs, const size_t *lens, int n)
{
    if (n < 0 || n > FE_MAX_IOV)
        return -EINVAL;
    struct iovec iov[FE_MAX_IOV + 1];
    for (int i = 0; i < n; i++)
        iov[i + 1] = (struct iovec){(void *)bufs[i], lens[i]};
    return reply_iov(fd, unique, iov, n + 1);
}

int fe_reply_xattr_size(int fd, uint64_t unique, uint32_t size)
{
    struct fuse_getxattr_out o = {.size = size};
    return reply_buf(fd, unique, &o, sizeof o);
}

int fe_notify_store(int fd, uint64_t nodeid, uint64_t offset, const void *buf, size_t len)
{
    struct fuse_out_header h = {.error = FUSE_NOTIFY_STORE, .unique = 0};
    struct fuse_notify_store_out o = {.nodeid = nodeid,
                                      .offset = offset,
                                      .size = (uint32_t)len};
    struct iovec iov[3] = {{&h, sizeof h}, {&o, sizeof o}, {(void *)buf, len}};
    h.len = (uint32_t)(sizeof h + sizeof o + len);
    return write_reply(fd, iov, 3);
}

/* -------------------------------------------------------------------- attributes */

static int valid_entry(const struct fe_engine *e, uint64_t nodeid, uint64_t *entry)
{
    if (nodeid == 0 || nodeid > e->ix.entries)
        return 0;
    *entry = nodeid - 1;
    return 1;
}

static void split_time(double t, uint64_t *sec, uint32_t *nsec)
{
    if (t <= 0) {
        *sec = 0;
        *nsec = 0;
        return;
    }
    *sec = (uint64_t)t;
    *nsec = (uint32_t)((t - (double)*sec) * 1e9);
}

static void fill_attr(const struct fe_engine *e, uint64_t entry, struct fuse_attr *a)
{
    const struct fe_index *ix = &e->ix;
    uint32_t mode = ix->mode[entry];
    memset(a, 0, sizeof *a);
    a->ino = entry + 1;
    a->size = is_dir(mode) ? 4096 : ix->size[entry];
    a->blocks = (a->size + 511) / 512;
    int64_t t = ix->mtime_ns[entry];
    int64_t sec = t / 1000000000, nsec = t % 1000000000;
    if (nsec < 0) {
        nsec += 1000000000;
        sec -= 1;
    }
    a->atime = a->mtime = a->ctime = (uint64_t)sec;
    a->atimensec = a->mtimensec = a->ctimensec = (uint32_t)nsec;
    a->mode = mode;
    a->nlink = is_dir(mode) ? e->nlink[entry] : 1;
    a->uid = ix->uid[entry];
    a->gid = ix->gid[entry];
    a->blksize = e->blksize;
}

static void fill_entry(const struct fe_engine *e, uint64_t entry, struct fuse_entry_out *o)
{
    memset(o, 0, sizeof *o);
    o->nodeid = entry + 1;
    o->generation = e->opt.generation;
    split_time(e->opt.entry_timeout, &o->entry_valid, &o->entry_valid_nsec);
    split_time(e->opt.attr_timeout, &o->attr_valid, &o->attr_valid_nsec);
    fill_attr(e, entry, &o->attr);
}

/* Name of ``entry`` (bounds-checked; NULL if the index points outside its names). */
static const uint8_t *entry_name(const struct fe_engine *e, uint64_t entry, size_t *len)
{
    uint64_t off = e->ix.name_off[entry], n = e->ix.name_len[entry];
    if (off > e->ix.names_len || n > e->ix.names_len - off)
        return NULL;
    *len = (size_t)n;
    return e->ix.names + off;
}

/* The children of directory ``entry`` as [first, end), clipped to the index. */
static void children(const struct fe_engine *e, uint64_t entry, uint64_t *first, uint64_t *end)
{
    uint64_t f = e->ix.data[entry], n = e->ix.size[entry];
    if (f > e->ix.entries)
        f = e->ix.entries;
    if (n > e->ix.entries - f)
        n = e->ix.entries - f;
    *first = f;
    *end = f + n;
}

/* ---------------------------------------------------------------------- handlers */

/* What a handler returns: < 0 an errno to answer; 0 answered; QUEUED for Python (which
 * counts it); REPLIED_ENOENT answered, counted as the error the caller sees. */
enum { QUEUED = 1, REPLIED_ENOENT = 2 };

struct req {
    struct fe_worker *w;
    const struct fuse_in_header *h;
    const uint8_t *arg; /* after the header */
    size_t arglen;
    int op;      /* its counter slot (enum fe_op) */
    uint64_t t0; /* when it was read, ns */
    int counted;
};

static void count(struct fe_worker *w, int op, uint64_t t0, int err);

/* Count ``r`` (once) — before its reply, so a reader that sees the answer sees it counted
 * too, as pyfuse3's boundary.fuse_op does. */
static void counted(struct req *r, int err)
{
    if (!r->counted) {
        count(r->w, r->op, r->t0, err);
        r->counted = 1;
    }
}

/* Answer the request ``w`` holds: into its ring entry, or on its /dev/fuse fd. ``err``
 * > 0 answers that errno; else ``iov[1..n)`` is the payload (iov[0] is the header's). */
static int worker_reply(struct fe_worker *w, uint64_t unique, int err, struct iovec *iov,
                        int n)
{
    if (w->ent)
        return ring_answer(w, unique, err, iov, n);
    if (err)
        return fe_reply_error(w->fd, unique, err);
    return reply_iov(w->fd, unique, iov, n);
}

/* Count, then answer ``r`` with ``buf`` (``err``: count it as the error the caller sees). */
static int answer(struct req *r, const void *buf, size_t len, int err)
{
    counted(r, err);
    struct iovec iov[2] = {{0}, {(void *)buf, len}};
    return worker_reply(r->w, r->h->unique, 0, iov, len ? 2 : 1);
}

static int do_lookup(struct req *r)
{
    struct fe_engine *e = r->w->e;
    uint64_t parent;
    if (!valid_entry(e, r->h->nodeid, &parent))
        return -ENOENT;
    if (!is_dir(e->ix.mode[parent]))
        return -ENOTDIR;
    size_t nlen = strnlen((const char *)r->arg, r->arglen);
    if (nlen > 255)
        return -ENAMETOOLONG;
    uint64_t lo, hi;
    children(e, parent, &lo, &hi);
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        size_t mlen;
        const uint8_t *m = entry_name(e, mid, &mlen);
        if (!m)
            return -EIO;
        int c = memcmp(m, r->arg, mlen < nlen ? mlen : nlen);
        if (c == 0)
            c = mlen < nlen ? -1 : mlen > nlen;
        if (c < 0)
            lo = mid + 1;
        else if (c > 0)
            hi = mid;
        else {
            struct fuse_entry_out o;
            fill_entry(e, mid, &o);
            return answer(r, &o, sizeof o, 0), 0;
        }
    }
    /* Not there, and never will be (the snapshot is immutable): a negative entry the
     * kernel caches for entry_timeout, so a second miss costs no request. */
    struct fuse_entry_out o = {0};
    split_time(e->opt.entry_timeout, &o.entry_valid, &o.entry_valid_nsec);
    answer(r, &o, sizeof o, 1);
    return REPLIED_ENOENT;
}

static int do_getattr(struct req *r)
{
    struct fe_engine *e = r->w->e;
    uint64_t entry;
    if (!valid_entry(e, r->h->nodeid, &entry))
        return -ENOENT;
    struct fuse_attr_out o = {0};
    split_time(e->opt.attr_timeout, &o.attr_valid, &o.attr_valid_nsec);
    fill_attr(e, entry, &o.attr);
    answer(r, &o, sizeof o, 0);
    return 0;
}

static int do_readlink(struct req *r)
{
    struct fe_engine *e = r->w->e;
    uint64_t entry;
    if (!valid_entry(e, r->h->nodeid, &entry))
        return -ENOENT;
    if (!S_ISLNK(e->ix.mode[entry]))
        return -EINVAL;
    uint64_t off = e->ix.data[entry], n = e->ix.size[entry];
    if (off > e->ix.names_len || n > e->ix.names_len - off)
        return -EIO;
    answer(r, e->ix.names + off, (size_t)n, 0);
    return 0;
}

/* A new handle in a free slot (NULL: out of memory). */
static struct fe_handle *handle_new(struct fe_engine *e)
{
    struct fe_handle *fh = calloc(1, sizeof *fh);
    if (!fh)
        return NULL;
    fh->prefetched_to = -1;
    pthread_mutex_init(&fh->lock, NULL);
    pthread_mutex_lock(&e->hlock);
    uint32_t i = 0;
    while (i < e->nhslots && e->hslots[i])
        i++;
    if (i == e->nhslots) {
        uint32_t n = e->nhslots ? e->nhslots * 2 : 64;
        struct fe_handle **t = realloc(e->hslots, n * sizeof *t);
        if (!t) {
            pthread_mutex_unlock(&e->hlock);
            pthread_mutex_destroy(&fh->lock);
            free(fh);
            return NULL;
        }
        memset(t + e->nhslots, 0, (n - e->nhslots) * sizeof *t);
        e->hslots = t;
        e->nhslots = n;
    }
    fh->fh = (uint64_t)++e->hgen << 32 | (i + 1);
    e->hslots[i] = fh;
    pthread_mutex_unlock(&e->hlock);
    return fh;
}

/* The handle the kernel calls ``id``, or NULL if it is not one of ours. The kernel
 * sends no READ on a handle after its RELEASE, so the pointer stays valid for the
 * request that asked. */
static struct fe_handle *handle_get(struct fe_engine *e, uint64_t id)
{
    uint32_t i = (uint32_t)id;
    struct fe_handle *fh = NULL;
    pthread_mutex_lock(&e->hlock);
    if (i >= 1 && i <= e->nhslots && e->hslots[i - 1] && e->hslots[i - 1]->fh == id)
        fh = e->hslots[i - 1];
    pthread_mutex_unlock(&e->hlock);
    return fh;
}

static void handle_free(struct fe_engine *e, uint64_t id)
{
    uint32_t i = (uint32_t)id;
    struct fe_handle *fh = NULL;
    pthread_mutex_lock(&e->hlock);
    if (i >= 1 && i <= e->nhslots && e->hslots[i - 1] && e->hslots[i - 1]->fh == id) {
        fh = e->hslots[i - 1];
        e->hslots[i - 1] = NULL;
    }
    pthread_mutex_unlock(&e->hlock);
    if (fh) {
        pthread_mutex_destroy(&fh->lock);
        free(fh);
    }
}

static int do_open(struct req *r)
{
    struct fe_engine *e = r->w->e;
    uint64_t entry;
    if (!valid_entry(e, r->h->nodeid, &entry))
        return -ENOENT;
    if (r->arglen < sizeof(struct fuse_open_in))
        return -EINVAL;
    const struct fuse_open_in *in = (const void *)r->arg;
    if ((in->flags & O_ACCMODE) != O_RDONLY || (in->flags & (O_TRUNC | O_APPEND)))
        return -EROFS;
    if (is_dir(e->ix.mode[entry]))
        return -EISDIR;
    struct fe_handle *fh = handle_new(e);
    if (!fh)
        return -ENOMEM;
    struct fuse_open_out o = {.fh = fh->fh, .open_flags = FOPEN_KEEP_CACHE};
    if (answer(r, &o, sizeof o, 0) < 0)
        handle_free(e, fh->fh); /* interrupted: the kernel never sees this fh */
    return 0;
}

static int do_release(struct req *r)
{
    if (r->arglen >= sizeof(struct fuse_release_in)) {
        handle_free(r->w->e, ((const struct fuse_release_in *)r->arg)->fh);
    }
    answer(r, NULL, 0, 0);
    return 0;
}

static int do_opendir(struct req *r)
{
    struct fe_engine *e = r->w->e;
    uint64_t entry;
    if (!valid_entry(e, r->h->nodeid, &entry))
        return -ENOENT;
    if (!is_dir(e->ix.mode[entry]))
        return -ENOTDIR;
    /* the listing never changes: the kernel may cache it (and keep it across opens) */
    struct fuse_open_out o = {.fh = 0, .open_flags = FOPEN_KEEP_CACHE | FOPEN_CACHE_DIR};
    answer(r, &o, sizeof o, 0);
    return 0;
}

static int do_readdir(struct req *r, int plus)
{
    struct fe_engine *e = r->w->e;
    uint64_t dir;
    if (!valid_entry(e, r->h->nodeid, &dir))
        return -ENOENT;
    if (!is_dir(e->ix.mode[dir]))
        return -ENOTDIR;
    if (r->arglen < sizeof(struct fuse_read_in))
        return -EINVAL;
    const struct fuse_read_in *in = (const void *)r->arg;
    size_t room = in->size < r->w->outlen ? in->size : r->w->outlen;
    uint64_t first, end;
    children(e, dir, &first, &end);
    size_t used = 0;
    for (uint64_t pos = in->offset; pos < end - first; pos++) {
        uint64_t child = first + pos;
        size_t nlen;
        const uint8_t *name = entry_name(e, child, &nlen);
        if (!name)
            return -EIO;
        size_t head = plus ? FUSE_NAME_OFFSET_DIRENTPLUS : FUSE_NAME_OFFSET;
        size_t rec = FUSE_DIRENT_ALIGN(head + nlen);
        if (used + rec > room)
            break;
        uint8_t *p = r->w->out + used;
        memset(p, 0, rec);
        struct fuse_dirent *d;
        if (plus) {
            struct fuse_direntplus *dp = (void *)p;
            fill_entry(e, child, &dp->entry_out);
            d = &dp->dirent;
        } else {
            d = (void *)p;
        }
        d->ino = child + 1;
        d->off = pos + 1;
        d->namelen = (uint32_t)nlen;
        d->type = (e->ix.mode[child] & S_IFMT) >> 12;
        memcpy(d->name, name, nlen);
        used += rec;
    }
    answer(r, r->w->out, used, 0);
    return 0;
}

static int do_statfs(struct req *r)
{
    struct fe_engine *e = r->w->e;
    struct fuse_statfs_out o = {0};
    o.st.bsize = o.st.frsize = 4096;
    o.st.blocks = (e->opt.dataset_bytes + 4095) / 4096;
    o.st.files = e->ix.entries;
    o.st.namelen = 255;
    answer(r, &o, sizeof o, 0);
    return 0;
}

/* ------------------------------------------------------------------------- queue */

static void wake(struct fe_engine *e)
{
    uint64_t one = 1;
    ssize_t rc = write(e->efd, &one, sizeof one);
    (void)rc; /* EAGAIN: the counter is already non-zero */
}

static int enqueue(struct fe_engine *e, const struct fe_request *q)
{
    pthread_mutex_lock(&e->qlock);
    if (e->qlen == e->qcap) {
        size_t cap = e->qcap ? e->qcap * 2 : 256;
        struct fe_request *nq = malloc(cap * sizeof *nq);
        if (!nq) {
            pthread_mutex_unlock(&e->qlock);
            return -ENOMEM;
        }
        for (size_t i = 0; i < e->qlen; i++)
            nq[i] = e->q[(e->qhead + i) % e->qcap];
        free(e->q);
        e->q = nq;
        e->qcap = cap;
        e->qhead = 0;
    }
    e->q[(e->qhead + e->qlen) % e->qcap] = *q;
    e->qlen++;
    pthread_mutex_unlock(&e->qlock);
    wake(e);
    return 0;
}

static int start_small(struct fe_engine *e, struct fe_fetch *f, const struct fe_request *q);

/* Queue ``q`` for Python, to be answered on the fd or ring entry its request came from;
 * or, when ``fetch`` has every chunk of [first, last] the tier lacks in flight, park it
 * there (fuse_fetch.h: answered by the fetch thread, or queued for Python if a chunk
 * does not land); or, a small file's READ, park it on its extent's fetch started here
 * (``start_small``). */
static int enqueue_for_python(struct fe_worker *w, struct fe_request *q,
                              struct fe_fetch *fetch, uint64_t first, uint64_t last)
{
    if (!w->ent) {
        q->fd = w->fd;
    } else {
        q->fd = ring_token(w->ent);
        atomic_store(&w->ent->state, ENT_PY); /* before another thread can answer it */
    }
    if (fetch && (fetch_park(fetch, first, last, q) || start_small(w->e, fetch, q)))
        return 0;
    int rc = enqueue(w->e, q);
    if (rc < 0 && w->ent)
        atomic_store(&w->ent->state, ENT_C);
    return rc;
}

size_t fe_take(struct fe_engine *e, struct fe_request *out, size_t max)
{
    pthread_mutex_lock(&e->qlock);
    size_t n = e->qlen < max ? e->qlen : max;
    for (size_t i = 0; i < n; i++)
        out[i] = e->q[(e->qhead + i) % e->qcap];
    if (n) {
        e->qhead = (e->qhead + n) % e->qcap;
        e->qlen -= n;
    }
    pthread_mutex_unlock(&e->qlock);
    return n;
}

static int do_xattr(struct req *r, int kind)
{
    struct fe_engine *e = r->w->e;
    uint64_t entry;
    if (!e->opt.xattrs)
        return -ENOSYS; /* answered once: the kernel stops asking */
    if (!valid_entry(e, r->h->nodeid, &entry))
        return -ENOENT;
    if (r->arglen < sizeof(struct fuse_getxattr_in))
        return -EINVAL;
    const struct fuse_getxattr_in *in = (const void *)r->arg;
    struct fe_request q = {.kind = kind,
                           .unique = r->h->unique,
                           .entry = entry,
                           .size = in->size,
                           .t0 = r->t0};
    if (kind == FE_GETXATTR) {
        const char *name = (const char *)(in + 1);
        size_t n = strnlen(name, r->arglen - sizeof *in);
        if (n >= sizeof q.name)
            return -ERANGE;
        memcpy(q.name, name, n);
    }
    r->w->c.queued++;
    int rc = enqueue_for_python(r->w, &q, NULL, 0, 0);
    return rc < 0 ? rc : QUEUED;
}

/* -------------------------------------------------------------------------- READ */

static const uint8_t *chunk_key(const struct fe_engine *e, uint64_t k)
{
    return e->ix.chunk_digests + k * 16;
}

/* The sequential-read bookkeeping of cache/prefetch.py ``Prefetcher.advise``, for one
 * handle: whether this read is random, and the chunks to start loading ahead. */
static int advise(struct fe_engine *e, struct fe_handle *fh, uint64_t offset, uint64_t size,
                  uint64_t last, uint64_t file_last, uint64_t *pstart, uint64_t *pstop)
{
    *pstart = *pstop = 0;
    pthread_mutex_lock(&fh->lock);
    fh->run = offset == fh->next_offset ? fh->run + 1 : 0;
    fh->next_offset = offset + size;
    int random = fh->run == 0;
    if (e->opt.prefetch_depth && fh->run >= e->opt.prefetch_trigger) {
        uint64_t start = last + 1;
        if (fh->prefetched_to >= 0 && (uint64_t)fh->prefetched_to + 1 > start)
            start = (uint64_t)fh->prefetched_to + 1;
        uint64_t stop = last + 1 + e->opt.prefetch_depth;
        if (stop > file_last + 1)
            stop = file_last + 1;
        if (start < stop) {
            fh->prefetched_to = (int64_t)stop - 1;
            *pstart = start;
            *pstop = stop;
        }
    }
    pthread_mutex_unlock(&fh->lock);
    return random;
}

struct hit {
    struct iovec iov[FE_MAX_IOV + 1];
    struct fe_slot *held[FE_MAX_IOV];
    int n; /* iovecs used, from 1 */
    int nheld;
    int units;
};

static int hold(struct hit *h, struct fe_slot *s, size_t at, size_t len)
{
    if (h->n > FE_MAX_IOV || at > s->len || len > s->len - at)
        return 0;
    h->held[h->nheld++] = s;
    h->iov[h->n++] = (struct iovec){(void *)(s->data + at), len};
    h->units++;
    return 1;
}

/* Bytes [lo, hi) of chunk ``k`` for file ``entry`` from the tier: the chunk, the small
 * file's own extent, or every block under the range. 1: held in ``h``; 0: a miss. */
/* The key of a file in one chunk: its one extent's digest; NULL for any other file. */
static const uint8_t *one_extent(const struct fe_index *ix, uint64_t entry)
{
    uint64_t base = ix->data[entry], c = ix->chunk_size, x = ix->ext[entry];
    if (!ix->size[entry] || base / c != (base + ix->size[entry] - 1) / c || x >= ix->extents)
        return NULL;
    return ix->ext_digests + x * 16;
}

/* READ ``q``, missed, of a file in one chunk (``fe_file_extent``): its one extent started
 * by the native fetch and ``q`` parked on it (fuse_fetch.h fetch_start_part), when Python
 * routed that chunk and gave C staging slots — it does when small files are read alone
 * (ReadPolicy.small_file: the dataset outgrows the tiers), slots of that limit, so a file
 * larger finds none. Else 0: the caller's. */
static int start_small(struct fe_engine *e, struct fe_fetch *f, const struct fe_request *q)
{
    const uint8_t *key;
    uint32_t len;
    if (fe_file_extent(e, q->entry, &key, &len) < 0)
        return 0;
    uint64_t c = e->ix.chunk_size, k = e->ix.data[q->entry] / c;
    return fetch_start_part(f, k, e->ix.data[q->entry] - k * c, len, key, q);
}

/* The tier key of block ``b`` of chunk ``k``: the chunk's digest, then ``b`` little-endian
 * (as reader.block_key). */
static void block_key(const struct fe_engine *e, uint64_t k, uint64_t b, uint8_t key[20])
{
    memcpy(key, chunk_key(e, k), 16);
    uint32_t b32 = (uint32_t)b;
    memcpy(key + 16, &b32, 4);
}

static int tier_part(struct fe_engine *e, uint64_t entry, uint64_t k, uint64_t lo, uint64_t hi,
                     struct hit *h)
{
    const struct fe_index *ix = &e->ix;
    if (h->nheld >= FE_MAX_IOV)
        return 0;
    struct fe_slot *s = tier_get(e->tier, chunk_key(e, k), 16);
    if (s) {
        if (hold(h, s, lo, hi - lo))
            return 1;
        tier_unref(e->tier, s);
        return 0;
    }
    uint64_t base = ix->data[entry], c = ix->chunk_size;
    const uint8_t *xkey = one_extent(ix, entry);
    if (xkey && (s = tier_get(e->tier, xkey, 16))) {
        if (hold(h, s, k * c + lo - base, hi - lo))
            return 1;
        tier_unref(e->tier, s);
        return 0;
    }
    uint64_t B = ix->block_size;
    if (!B)
        return 0;
    for (uint64_t b = lo / B; b <= (hi - 1) / B; b++) {
        uint8_t key[20];
        block_key(e, k, b, key);
        if (h->nheld >= FE_MAX_IOV || !(s = tier_get(e->tier, key, 20)))
            return 0;
        uint64_t from = lo > b * B ? lo - b * B : 0;
        uint64_t to = (hi < (b + 1) * B ? hi : (b + 1) * B) - b * B;
        if (!hold(h, s, from, to - from)) {
            tier_unref(e->tier, s);
            return 0;
        }
    }
    return 1;
}

static void release_hit(struct fe_engine *e, struct hit *h)
{
    for (int i = 0; i < h->nheld; i++)
        tier_unref(e->tier, h->held[i]);
    h->nheld = 0;
}

/* READ [offset, offset + size) of ``entry``, its chunks first..last: held in ``h`` from
 * the tier (1), or a miss (0, nothing held). */
static int read_hit(struct fe_engine *e, uint64_t entry, uint64_t offset, uint64_t end,
                    uint64_t first, uint64_t last, struct hit *h)
{
    const struct fe_index *ix = &e->ix;
    uint64_t c = ix->chunk_size, base = ix->data[entry];
    h->n = 1;
    h->nheld = 0;
    h->units = 0;
    int hit = 1;
    for (uint64_t k = first; k <= last && hit; k++) {
        uint64_t lo = (base + offset > k * c ? base + offset : k * c) - k * c;
        uint64_t hi = (base + end < (k + 1) * c ? base + end : (k + 1) * c) - k * c;
        hit = tier_part(e, entry, k, lo, hi, h);
    }
    if (!hit)
        release_hit(e, h);
    return hit;
}

/* What a READ of [offset, offset + size) of ``entry`` covers: its end, clipped to the
 * file (``offset >= *end``: nothing), and the chunks first..last it touches. */
static void read_span(const struct fe_engine *e, uint64_t entry, uint64_t offset,
                      uint64_t size, uint64_t *end, uint64_t *first, uint64_t *last)
{
    const struct fe_index *ix = &e->ix;
    uint64_t fsize = ix->size[entry], c = ix->chunk_size, base = ix->data[entry];
    *end = offset + size < fsize ? offset + size : fsize;
    *first = (base + offset) / c;
    *last = *end > offset ? (base + *end - 1) / c : *first;
}

static void count_into(struct fe_counters *c, int op, uint64_t t0, int err);

/* A READ of ``bytes`` answered from ``units`` tier buffers, counted in ``c``. */
static void count_hit(struct fe_counters *c, uint64_t bytes, int units)
{
    c->read_hits++;
    c->read_hit_bytes += bytes;
    c->memory_hits += (uint64_t)units;
}

/* Queued READ ``q`` ([offset, end) over chunks first..last) answered from the tier if it
 * holds them all, counted with the READs answered again; 0: it does not. */
static int answer_again(struct fe_engine *e, const struct fe_request *q, uint64_t end,
                        uint64_t first, uint64_t last)
{
    struct hit h;
    if (!read_hit(e, q->entry, q->offset, end, first, last, &h))
        return 0;
    reply_iov(q->fd, q->unique, h.iov, h.n);
    release_hit(e, &h);
    pthread_mutex_lock(&e->alock);
    count_hit(&e->again, end - q->offset, h.units);
    count_into(&e->again, FE_OP_READ, q->t0, 0);
    e->again.late_hits++;
    pthread_mutex_unlock(&e->alock);
    return 1;
}

int fe_read_or_park(struct fe_engine *e, const struct fe_request *q)
{
    if (q->entry >= e->ix.entries || !S_ISREG(e->ix.mode[q->entry]))
        return 0; /* (Python's READ tuple: not trusted blindly) */
    uint64_t end, first, last;
    read_span(e, q->entry, q->offset, q->size, &end, &first, &last);
    if (q->offset >= end)
        return 0;
    if (answer_again(e, q, end, first, last))
        return 1;
    struct fe_fetch *f = atomic_load(&e->fetch); /* one of its chunks in flight */
    if (!f)
        return 0;
    /* Nothing to park on may also mean its last chunk landed between the two looks: the
     * READ is then answered from the tier, not left to Python for a trio task. */
    return fetch_park(f, first, last, q) || answer_again(e, q, end, first, last);
}

void fe_read_again(struct fe_engine *e, const struct fe_request *q)
{
    if (!fe_read_or_park(e, q))
        enqueue(e, q);
}

int fe_queue(struct fe_engine *e, const struct fe_request *q) { return enqueue(e, q); }

static int do_read(struct req *r)
{
    struct fe_engine *e = r->w->e;
    const struct fe_index *ix = &e->ix;
    uint64_t entry;
    if (!valid_entry(e, r->h->nodeid, &entry))
        return -ENOENT;
    if (r->arglen < sizeof(struct fuse_read_in))
        return -EINVAL;
    const struct fuse_read_in *in = (const void *)r->arg;
    uint64_t offset = in->offset, end, first, last;
    read_span(e, entry, offset, in->size, &end, &first, &last);
    if (offset >= end)
        return answer(r, NULL, 0, 0), 0;
    uint64_t file_last = (ix->data[entry] + ix->size[entry] - 1) / ix->chunk_size;
    if (last >= ix->chunks || first > last)
        return -EIO;
    if (file_last >= ix->chunks)
        file_last = ix->chunks - 1;
    struct fe_handle *fh = handle_get(e, in->fh);
    int random = 0;
    uint64_t pstart = 0, pstop = 0;
    if (fh)
        random = advise(e, fh, offset, in->size, last, file_last, &pstart, &pstop);
    struct hit h;
    int queued = 0;
    if (read_hit(e, entry, offset, end, first, last, &h)) {
        count_hit(&r->w->c, end - offset, h.units);
        counted(r, 0);
        worker_reply(r->w, r->h->unique, 0, h.iov, h.n);
        release_hit(e, &h);
    } else {
        struct fe_request q = {.kind = FE_READ,
                               .unique = r->h->unique,
                               .entry = entry,
                               .offset = offset,
                               .size = in->size,
                               .random = random,
                               .t0 = r->t0};
        r->w->c.read_misses++;
        r->w->c.queued++;
        if (enqueue_for_python(r->w, &q, atomic_load(&e->fetch), first, last) < 0)
            return -ENOMEM;
        queued = QUEUED;
    }
    if (pstop > pstart) {
        /* chunks Python routed start here (fetch_start); from the first that does not,
         * the rest are hinted to Python */
        struct fe_fetch *f = atomic_load(&e->fetch);
        for (uint64_t k = pstart; k < pstop; k++)
            if (!tier_has(e->tier, chunk_key(e, k), 16) && !(f && fetch_start(f, k))) {
                struct fe_request q = {.kind = FE_PREFETCH,
                                       .fd = -1,
                                       .unique = last,
                                       .entry = entry,
                                       .offset = k,
                                       .size = pstop};
                r->w->c.prefetch_hints++;
                enqueue(e, &q);
                break;
            }
    }
    return queued;
}

/* ---------------------------------------------------------------------- dispatch */

static const uint64_t bounds_ns[FE_BUCKETS - 1] = {100000,     250000,        500000,
                                                   1000000,    2500000,       5000000,
                                                   10000000,   25000000,      50000000,
                                                   100000000,  250000000,     500000000,
                                                   1000000000, 2500000000ULL, 10000000000ULL};

uint64_t fe_now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ULL + (uint64_t)t.tv_nsec;
}

static void count_into(struct fe_counters *c, int op, uint64_t t0, int err)
{
    uint64_t dt = fe_now_ns() - t0;
    int b = 0;
    while (b < FE_BUCKETS - 1 && dt > bounds_ns[b])
        b++;
    c->count[op]++;
    c->ns[op] += dt;
    c->buckets[op][b]++;
    if (err)
        c->errors[op]++;
}

static void count(struct fe_worker *w, int op, uint64_t t0, int err)
{
    count_into(&w->c, op, t0, err);
}

/* The solo gate.  One task reading one file sequentially (dd, fio's one psync job, a
 * loader with one worker) sends the kernel's readahead as bursts of four 1 MiB READs;
 * with two threads in read(2) the kernel wakes both, and the second, woken on the
 * reader's CPU, preempted the reader, which then copied its pages only after every READ
 * of the burst was answered, while the other CPU idled (fuse:fuse_request_* and sched
 * tracepoints, dd bs=1M over a 1 GiB file: no READ out for 93-123 ms of ~310, 0.7 ms per
 * drained burst, against 11-13 ms and 0.1 ms for single-threaded ramfs-c; one thread
 * pipelines as ramfs-c does).  But a task waiting on each request in turn (random 4 KiB
 * READs, stat, ls) is served fastest by a thread woken on its own, now idle, CPU: with
 * one thread fio's random 4 KiB j1 fell from 80,543 to 20,474 IOPS, single-threaded
 * ramfs-c's figure (a cross-CPU wake-up per request).  So the threads after the first
 * wait here while, for FE_SOLO_NS, every request was a READ of FE_SOLO_READ or more
 * from one task (readahead); any other request, or another task's, opens the gate. */
#define FE_SOLO_NS 20000000ull
#define FE_SOLO_READ (256u << 10) /* a READ this large is readahead, answered ahead of need */

/* The crowd rule.  More tasks than CPUs, each sending short requests in turn (8 workers
 * opening and reading ImageNet-like files on 2 CPUs): no CPU is idle for a second
 * thread, and each request that woke it from read(2) cost a sleep and a wake-up; the
 * threads slept 1.6-1.8 times per file each, and a file cost 65-78 us of their CPU
 * against 43-46 when they happened not to sleep (14-17k against 18-20k files/s, the
 * mode changing from one pass to the next); one thread: 40-42 us, 19-20k files/s every
 * pass (ramfs-c, one thread: 40-42 us).  So while, over the last FE_SOLO_NS, more tasks
 * than CPUs sent requests averaging under FE_CROWD_SHORT_NS that one thread could have
 * answered alone (all threads' time in dispatch under FE_CROWD_BUSY_PCT of the window),
 * the gate stays as it is (closed, once its last opening ran out). Long requests (4
 * sequential readers' 1 MiB READs: one thread 0.88x of two) or a busy thread (a large
 * machine's crowd) leave it to the solo gate's own reasons. */
#define FE_CROWD_SHORT_NS 50000ull
#define FE_CROWD_BUSY_PCT 90u

/* After each /dev/fuse request (arrived ``t0``) of task ``pid``: count it, and judge the
 * window that ended (one thread, by CAS on crowd_since). One shared write per task and
 * window; the rest are this thread's own totals. */
static void crowd_note(struct fe_worker *w, uint32_t pid, uint64_t t0)
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
static void solo_note(struct fe_worker *w, const struct fuse_in_header *h, size_t n,
                      uint64_t now)
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

static void dispatch_one(struct fe_worker *w, const uint8_t *buf, size_t n, uint64_t t0);

static void dispatch(struct fe_worker *w, const uint8_t *buf, size_t n)
{
    uint64_t t0 = fe_now_ns();
    dispatch_one(w, buf, n, t0);
    if (!w->ent && n >= sizeof(struct fuse_in_header))
        crowd_note(w, ((const struct fuse_in_header *)buf)->pid, t0);
}

static void dispatch_one(struct fe_worker *w, const uint8_t *buf, size_t n, uint64_t t0)
{
    if (n < sizeof(struct fuse_in_header))
        return;
    const struct fuse_in_header *h = (const void *)buf;
    struct req r = {w, h, buf + sizeof *h, n - sizeof *h, FE_OP_OTHER, t0, 0};
    if (!w->ent) {
        solo_note(w, h, n, r.t0);
        if (w != &w->e->workers[0])
            w->c.shared_requests++;
    }
    if (h->unique >> 63)
        w->c.resent++; /* a dead predecessor read it; the kernel sent it again */
    int rc;
    switch (h->opcode) {
    case FUSE_LOOKUP:
        r.op = FE_OP_LOOKUP;
        rc = do_lookup(&r);
        break;
    case FUSE_GETATTR:
        r.op = FE_OP_GETATTR;
        rc = do_getattr(&r);
        break;
    case FUSE_READLINK:
        r.op = FE_OP_READLINK;
        rc = do_readlink(&r);
        break;
    case FUSE_OPEN:
        r.op = FE_OP_OPEN;
        rc = do_open(&r);
        break;
    case FUSE_READ:
        r.op = FE_OP_READ;
        rc = do_read(&r);
        break;
    case FUSE_RELEASE:
        r.op = FE_OP_RELEASE;
        rc = do_release(&r);
        break;
    case FUSE_OPENDIR:
        r.op = FE_OP_OPENDIR;
        rc = do_opendir(&r);
        break;
    case FUSE_READDIR:
        r.op = FE_OP_READDIR;
        rc = do_readdir(&r, 0);
        break;
    case FUSE_READDIRPLUS:
        r.op = FE_OP_READDIR;
        rc = do_readdir(&r, 1);
        break;
    case FUSE_RELEASEDIR:
        r.op = FE_OP_RELEASEDIR;
        answer(&r, NULL, 0, 0);
        rc = 0;
        break;
    case FUSE_STATFS:
        r.op = FE_OP_STATFS;
        rc = do_statfs(&r);
        break;
    case FUSE_GETXATTR:
        r.op = FE_OP_GETXATTR;
        rc = do_xattr(&r, FE_GETXATTR);
        break;
    case FUSE_LISTXATTR:
        r.op = FE_OP_LISTXATTR;
        rc = do_xattr(&r, FE_LISTXATTR);
        break;
    case FUSE_FORGET:
    case FUSE_BATCH_FORGET: /* inodes are entry numbers: nothing to forget */
        w->c.count[FE_OP_FORGET]++;
        return;
    case FUSE_INTERRUPT: /* requests are short or queued; the reply comes anyway */
    case FUSE_NOTIFY_REPLY:
        return;
    case FUSE_DESTROY:
        r.op = FE_OP_OTHER;
        answer(&r, NULL, 0, 0);
        rc = 0;
        break;
    case FUSE_SETATTR:
    case FUSE_SYMLINK:
    case FUSE_MKNOD:
    case FUSE_MKDIR:
    case FUSE_UNLINK:
    case FUSE_RMDIR:
    case FUSE_RENAME:
    case FUSE_LINK:
    case FUSE_WRITE:
    case FUSE_SETXATTR:
    case FUSE_REMOVEXATTR:
    case FUSE_CREATE:
    case FUSE_FALLOCATE:
    case FUSE_RENAME2:
    case FUSE_COPY_FILE_RANGE:
    case FUSE_TMPFILE:
        r.op = FE_OP_EROFS;
        rc = -EROFS;
        break;
    default: /* flush, fsync, locks, ioctl, lseek, …: the kernel's own */
        r.op = FE_OP_ENOSYS;
        rc = -ENOSYS;
        break;
    }
    if (rc < 0) {
        counted(&r, r.op != FE_OP_ENOSYS);
        worker_reply(w, h->unique, -rc, NULL, 1);
    } else if (rc != QUEUED) {
        counted(&r, 0); /* answered without answer(): nothing to count late */
    }
}

/* A request thread's buffers (a /dev/fuse reader's or an io_uring queue's): one request
 * in, and READDIR replies out, of max_pages pages (32, the kernel's default, before INIT
 * negotiated more). 0, or -ENOMEM (the caller frees what was allocated). */
static size_t reply_room(const struct fe_engine *e)
{
    return (size_t)(e->max_pages ? e->max_pages : 32) * 4096;
}

static int worker_buffers(struct fe_worker *w, struct fe_engine *e, int fd)
{
    w->e = e;
    w->fd = fd;
    w->outlen = reply_room(e);
    w->in = malloc(FE_REQ_BUF);
    w->out = malloc(w->outlen);
    return w->in && w->out ? 0 : -ENOMEM;
}

/* ---------------------------------------------------------------------- io_uring */

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

static int ring_token(const struct fe_uent *ent)
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
static int ring_answer(struct fe_worker *w, uint64_t unique, int err, struct iovec *iov, int n)
{
    struct fe_uent *ent = w->ent;
    ring_fill(ent, unique, err, iov, n, &w->c);
    ring_cmd(ent->q, ent, FE_IO_URING_CMD_COMMIT_AND_FETCH);
    w->ent = NULL; /* answered: nothing more goes into it */
    return 0;
}

/* Python's reply to a ring request (any thread): fill the entry, hand it to its queue. */
static int ring_reply(int token, uint64_t unique, int err, struct iovec *iov, int n)
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

static void ring_signal_stop(struct fe_engine *e)
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
static int ring_start(struct fe_engine *e, char *err, size_t errlen)
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

static void ring_join(struct fe_engine *e)
{
    for (int i = 0; i < e->nqueues; i++)
        if (e->queues[i].started) {
            pthread_join(e->queues[i].thread, NULL);
            e->queues[i].started = 0;
        }
}

/* After the queue threads are joined: their rings (closing one cancels what the kernel
 * still holds of it), buffers and the token slot. */
static void ring_free(struct fe_engine *e)
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
static int ring_probe(void)
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
static void ring_refuse(struct fe_engine *e)
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

/* ----------------------------------------------------------------------- threads */

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

int fe_init(struct fe_engine *e, char *err, size_t errlen)
{
    uint8_t *buf = malloc(FE_REQ_BUF);
    if (!buf)
        return -ENOMEM;
    ssize_t n;
    do
        n = read(e->fd, buf, FE_REQ_BUF);
    while (n < 0 && errno == EINTR);
    int rc = 0;
    const struct fuse_in_header *h = (const void *)buf;
    if (n < (ssize_t)(sizeof *h + 16) || h->opcode != FUSE_INIT) {
        set_err(err, errlen, "no INIT from the kernel (%s)",
                n < 0 ? strerror(errno) : "short");
        rc = n < 0 ? -errno : -EPROTO;
        goto out;
    }
    struct fuse_init_in in = {0};
    memcpy(&in, h + 1, (size_t)n - sizeof *h < sizeof in ? (size_t)n - sizeof *h : sizeof in);
    struct fuse_init_out o = {.major = FUSE_KERNEL_VERSION,
                              .minor = FUSE_KERNEL_MINOR_VERSION};
    if (in.major != FUSE_KERNEL_VERSION || in.minor < 31) {
        reply_buf(e->fd, h->unique, &o, sizeof o);
        set_err(err, errlen, "kernel FUSE %u.%u: need 7.31 or later", in.major, in.minor);
        rc = -EPROTO;
        goto out;
    }
    uint64_t offered = in.flags | (in.flags & FUSE_INIT_EXT ? (uint64_t)in.flags2 << 32 : 0);
    uint64_t wanted = FUSE_ASYNC_READ | FUSE_PARALLEL_DIROPS | FUSE_DO_READDIRPLUS |
                      FUSE_MAX_PAGES | FUSE_CACHE_SYMLINKS | FUSE_INIT_EXT;
    if (e->opt.uring && (offered & FE_FUSE_OVER_IO_URING) && ring_probe())
        wanted |= FE_FUSE_OVER_IO_URING; /* the kernel offers it only with enable_uring=Y */
    uint64_t flags = offered & wanted;
    uint32_t pages = e->opt.max_pages ? e->opt.max_pages : 256;
    o.minor = in.minor < FUSE_KERNEL_MINOR_VERSION ? in.minor : FUSE_KERNEL_MINOR_VERSION;
    o.max_readahead = in.max_readahead;
    o.flags = (uint32_t)flags;
    o.flags2 = (uint32_t)(flags >> 32);
    o.max_background = (uint16_t)(e->opt.max_background ? e->opt.max_background : 64);
    o.congestion_threshold = (uint16_t)(e->opt.congestion_threshold
                                            ? e->opt.congestion_threshold
                                            : o.max_background * 3 / 4);
    o.max_write = FE_MAX_WRITE;
    o.time_gran = 1;
    o.max_pages = (uint16_t)pages;
    if (reply_buf(e->fd, h->unique, &o, sizeof o) < 0) {
        set_err(err, errlen, "INIT reply: %s", strerror(errno));
        rc = -EIO;
        goto out;
    }
    e->minor = o.minor;
    e->flags = flags;
    e->uring = (flags & FE_FUSE_OVER_IO_URING) != 0;
    e->max_pages = flags & FUSE_MAX_PAGES ? pages : 32;
    e->max_readahead = o.max_readahead;
out:
    free(buf);
    return rc;
}

void fe_adopt(struct fe_engine *e, uint32_t minor, uint64_t flags, uint32_t max_pages,
              uint32_t max_readahead)
{
    e->minor = minor;
    e->flags = flags;
    e->max_pages = max_pages ? max_pages : 32;
    e->max_readahead = max_readahead;
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

int fe_notify_resend(int fd)
{
    struct fuse_out_header h = {.len = sizeof h, .error = FE_NOTIFY_RESEND, .unique = 0};
    struct iovec iov = {&h, sizeof h};
    return write_reply(fd, &iov, 1);
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

static void add_counters(struct fe_counters *sum, const struct fe_counters *c)
{
    {
        for (int op = 0; op < FE_NOPS; op++) {
            sum->count[op] += c->count[op];
            sum->errors[op] += c->errors[op];
            sum->ns[op] += c->ns[op];
            for (int b = 0; b < FE_BUCKETS; b++)
                sum->buckets[op][b] += c->buckets[op][b];
        }
        sum->read_hits += c->read_hits;
        sum->read_hit_bytes += c->read_hit_bytes;
        sum->memory_hits += c->memory_hits;
        sum->read_misses += c->read_misses;
        sum->queued += c->queued;
        sum->prefetch_hints += c->prefetch_hints;
        sum->late_hits += c->late_hits;
        sum->resent += c->resent;
        sum->ring_requests += c->ring_requests;
        sum->ring_copy_bytes += c->ring_copy_bytes;
        sum->ring_copy_ns += c->ring_copy_ns;
        sum->ring_lost += c->ring_lost;
        sum->gate_waits += c->gate_waits;
        sum->shared_requests += c->shared_requests;
        sum->gate_opened_tasks += c->gate_opened_tasks;
        sum->gate_opened_requests += c->gate_opened_requests;
        sum->gate_crowded += c->gate_crowded;
    }
}

void fe_counters(struct fe_engine *e, struct fe_counters *sum)
{
    memset(sum, 0, sizeof *sum);
    for (int i = 0; i < e->nworkers; i++)
        add_counters(sum, &e->workers[i].c); /* racy reads of plain u64s */
    for (int i = 0; i < e->nqueues; i++)
        add_counters(sum, &e->queues[i].w.c);
    sum->spliced = atomic_load_explicit(&e->spliced, memory_order_relaxed);
    sum->spliced_bytes = atomic_load_explicit(&e->spliced_bytes, memory_order_relaxed);
    pthread_mutex_lock(&e->alock);
    add_counters(sum, &e->again);
    pthread_mutex_unlock(&e->alock);
    struct fe_fetch *f = atomic_load(&e->fetch);
    if (f) {
        struct fe_fetch_counters fc;
        fetch_counters(f, &fc);
        sum->fetch_posted = fc.posted;
        sum->fetch_landed = fc.landed;
        sum->fetch_failed = fc.failed;
        sum->fetch_redundant = fc.redundant;
        sum->fetch_parked = fc.parked;
        sum->fetch_answered = fc.answered;
        sum->fetch_started = fc.started;
        sum->fetch_started_parts = fc.started_parts;
    }
}

int fe_fetch_enable(struct fe_engine *e, const struct ks_capi *api, char *err, size_t errlen)
{
    if (atomic_load(&e->fetch))
        return 0;
    if (!api || api->abi != KS_CAPI_ABI) {
        set_err(err, errlen, "fetch: the soft engine's C API is not ABI %d", KS_CAPI_ABI);
        return -EINVAL;
    }
    struct fe_fetch *f = fetch_new(e, e->tier, e->ix.chunk_digests, e->ix.chunk_len,
                                   e->ix.chunks, api, err, errlen);
    if (!f)
        return -ENOMEM;
    atomic_store(&e->fetch, f);
    return 0;
}

struct fe_fetch *fe_fetcher(struct fe_engine *e) { return atomic_load(&e->fetch); }

int fe_chunk_block(struct fe_engine *e, uint64_t chunk, uint64_t block, uint8_t key[20],
                   uint32_t *len)
{
    const struct fe_index *ix = &e->ix;
    uint64_t B = ix->block_size;
    if (chunk >= ix->chunks || !B || block > UINT32_MAX || block * B >= ix->chunk_len[chunk])
        return -EINVAL;
    block_key(e, chunk, block, key);
    uint64_t left = ix->chunk_len[chunk] - block * B;
    *len = (uint32_t)(left < B ? left : B);
    return 0;
}

int fe_file_extent(struct fe_engine *e, uint64_t entry, const uint8_t **key, uint32_t *len)
{
    const struct fe_index *ix = &e->ix;
    if (entry >= ix->entries || !S_ISREG(ix->mode[entry]) || ix->size[entry] > UINT32_MAX ||
        !(*key = one_extent(ix, entry)))
        return -EINVAL;
    *len = (uint32_t)ix->size[entry];
    return 0;
}

void fe_destroy(struct fe_engine *e)
{
    if (!e)
        return;
    if (e->nqueues) { /* joined already, unless fe_start failed half-way */
        ring_signal_stop(e);
        ring_join(e);
    }
    ring_free(e);
    for (int i = 0; i < e->nworkers; i++) {
        struct fe_worker *w = &e->workers[i];
        if (i && w->fd >= 0)
            close(w->fd);
        free(w->in);
        free(w->out);
    }
    free(e->workers);
    for (uint32_t i = 0; i < e->nhslots; i++)
        if (e->hslots[i]) {
            pthread_mutex_destroy(&e->hslots[i]->lock);
            free(e->hslots[i]);
        }
    free(e->hslots);
    if (e->fd >= 0)
        close(e->fd);
    if (e->efd >= 0)
        close(e->efd);
    free(e->q);
    free(e->nlink);
    fetch_free(atomic_load(&e->fetch)); /* before the tier: it puts into it */
    tier_free(e->tier);
    free(e);
}
