/* fuse_engine_i.h — what crosses the native FUSE engine's files: its structs, and the
 * functions one file defines and another calls (fuse_engine.h is the public API; the
 * native fetch, fuse_fetch.c, calls back into the engine through the last block here).
 *
 * The engine's files:
 *   fuse_engine.c    fe_create, fe_init (INIT) / fe_adopt, fe_tier_* (the table of
 *                    fuse_tier.c, verified buffers by key, for Python), fe_counters, the
 *                    native fetch's start, fe_destroy
 *   fuse_mount.c     fe_mount / fe_unmount: mount(2) with a /dev/fuse fd (root)
 *   fuse_reply.c     reply_iov and friends: one writev per reply, header + caller's buffers
 *                    (a large READ's by vmsplice + splice, fuse.splice); notifications
 *   fuse_ops.c       fill_attr / fill_entry from the index arrays (bounds-checked); one
 *                    function per opcode; dispatch() picks one and counts it
 *   fuse_read.c      stream bookkeeping (prefetch), then tier hit → writev, else queue
 *   fuse_queue.c     misses and xattrs for Python, an eventfd per engine
 *   fuse_uring.c     queues per CPU: register entries, serve CQEs, commit replies (Python's
 *                    through a mailbox the queue's thread drains)
 *   fuse_threads.c   the solo gate, fe_start (clone a /dev/fuse fd per thread), fe_stop,
 *                    fe_join
 *
 * Slot lifetime: a slot in the table holds one reference for the table; a READ that
 * replies from it takes one under its stripe lock and drops it after writev. Whoever
 * drops the last reference retires the slot: fe_tier_discard hands the owner straight
 * back (the binding releases the Python buffer), a request thread puts it on the dead
 * list that fe_tier_reap empties from Python. No buffer is released while a reply
 * still points into it, and the request threads never touch a Python object.
 *
 * Every function declared here is hidden: the extension exports only what fuse_engine.h
 * and fuse_fetch.h name, so a short name here (dispatch, answer) binds to this engine.
 */
#ifndef KSPEEDFS_FUSE_ENGINE_I_H
#define KSPEEDFS_FUSE_ENGINE_I_H

#include <liburing.h>
#include <linux/fuse.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#include "fuse_engine.h"
#include "fuse_fetch.h"
#include "fuse_tier.h"
#include "fuse_uring_abi.h"
#include "tuning.h"

#define FE_MAX_THREADS 256
#define FE_MAX_IOV 64
#define FE_MAX_WRITE (128 * 1024)
#define FE_REQ_BUF (FE_MAX_WRITE + 4096)

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
    uint32_t *nlink; /* a directory's st_nlink once counted, 0 before (fuse_ops.c) */
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


#pragma GCC visibility push(hidden)

/* fuse_engine.c */
void set_err(char *err, size_t errlen, const char *fmt, ...);

/* fuse_reply.c: a reply of iov[1..n) (iov[0] is left for the header), or of ``buf`` */
int reply_iov(int fd, uint64_t unique, struct iovec *iov, int n);
int reply_buf(int fd, uint64_t unique, const void *buf, size_t len);

/* fuse_ops.c */
int is_dir(uint32_t mode);
int valid_entry(const struct fe_engine *e, uint64_t nodeid, uint64_t *entry);
void counted(struct req *r, int err);
int worker_reply(struct fe_worker *w, uint64_t unique, int err, struct iovec *iov, int n);
int answer(struct req *r, const void *buf, size_t len, int err);
struct fe_handle *handle_get(struct fe_engine *e, uint64_t id);
void count_into(struct fe_counters *c, int op, uint64_t t0, int err);
void dispatch(struct fe_worker *w, const uint8_t *buf, size_t n);

/* fuse_queue.c */
void wake(struct fe_engine *e);
int enqueue(struct fe_engine *e, const struct fe_request *q);
int enqueue_read(struct fe_engine *e, const struct fe_read *rd);
int read_for_python(struct fe_worker *w, struct fe_read *rd, struct fe_fetch *fetch,
                    uint64_t first, uint64_t last);
int xattr_for_python(struct fe_worker *w, struct fe_request *q);

/* fuse_read.c */
int start_small(struct fe_engine *e, struct fe_fetch *f, const struct fe_read *rd);
/* READ ``rd``, missed and random inside one block of one chunk: that block started by the
 * native fetch, ``rd`` parked on it (fetch_start_block), when Python routed the chunk (it
 * does for chunks random reads keep in blocks). Else 0: the caller's. */
int start_block(struct fe_engine *e, struct fe_fetch *f, const struct fe_read *rd);
int do_read(struct req *r);

/* fuse_threads.c */
void crowd_note(struct fe_worker *w, uint32_t pid, uint64_t t0);
void solo_note(struct fe_worker *w, const struct fuse_in_header *h, size_t n, uint64_t now);
size_t reply_room(const struct fe_engine *e);
int worker_buffers(struct fe_worker *w, struct fe_engine *e, int fd);

/* fuse_uring.c. Ring replies: Python's, by token, and the queue thread's own for the
 * request in hand. */
int ring_reply(int token, uint64_t unique, int err, struct iovec *iov, int n);
int ring_answer(struct fe_worker *w, uint64_t unique, int err, struct iovec *iov, int n);
int ring_token(const struct fe_uent *ent);
void ring_signal_stop(struct fe_engine *e);
int ring_start(struct fe_engine *e, char *err, size_t errlen);
void ring_join(struct fe_engine *e);
void ring_free(struct fe_engine *e);
int ring_probe(void);
void ring_refuse(struct fe_engine *e);

/* For the native fetch (fuse_fetch.c): answer a parked READ again (fe_read_or_park), or
 * queue it for Python; queue a request or event for Python; and the engine's clock
 * (CLOCK_MONOTONIC, ns: a request's t0, a C-started fetch's start and deadline). */
void fe_read_again(struct fe_engine *e, const struct fe_read *rd);
/* Answer READ ``rd`` of a small file from ``buf``, its one extent's verified bytes (``len``
 * of them, digest ``key``), which are in no tier: 1; 0 when ``rd`` is of another file. */
int fe_read_from(struct fe_engine *e, const struct fe_read *rd, const uint8_t *key,
                 const uint8_t *buf, uint32_t len);
int fe_queue(struct fe_engine *e, const struct fe_request *q);
uint64_t fe_now_ns(void);

#pragma GCC visibility pop

#endif
