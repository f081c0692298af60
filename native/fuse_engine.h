/* The native FUSE data plane: a multi-threaded request loop on /dev/fuse that answers
 * from an immutable manifest snapshot and a table of verified memory-tier buffers,
 * and hands what it cannot answer (READ misses, xattrs) to Python.
 *
 *   kernel ── /dev/fuse (one cloned fd per thread) ──► fe_thread: read one request
 *     LOOKUP GETATTR READLINK OPEN RELEASE OPENDIR      answered here, from fe_index
 *     READDIR(PLUS) RELEASEDIR STATFS, EROFS, ENOSYS     (no lock, no allocation)
 *     READ: every byte in fe_tier?                       writev(header, tier buffers)
 *           else                                        ─► fe_queue ─► eventfd ─► trio
 *     GETXATTR LISTXATTR (when xattrs are on)           ─► fe_queue (same path)
 *   Python answers a queued request with fe_reply_* on the fd it came from.
 *
 * FUSE over io_uring (kernel 6.14+, ``uring`` in fe_options, fuse_uring_abi.h): when INIT
 * negotiated it, fe_start also registers one io_uring queue per possible CPU, each served
 * by a thread pinned to its CPU; the kernel then sends requests through the queue of
 * the CPU the caller runs on, and the same dispatch answers them (into the entry's
 * payload buffer, committed with COMMIT_AND_FETCH). A request taken from a ring is
 * queued for Python with a negative "fd": a ring token, which fe_reply_* route back to
 * that ring entry. FORGET, INTERRUPT and notifications stay on /dev/fuse.
 *
 * Nothing in the engine's files touches Python: the threads never take the GIL. The binding
 * (fuse_engine_py.c) owns the Python objects behind the index arrays and the tier
 * buffers and releases them only when the engine says nothing points into them
 * (fe_tier_discard / fe_tier_reap).
 *
 * Trust: the kernel is trusted (it is the only peer of /dev/fuse); the manifest is
 * signed and validated by Python, and every index read here is bounds-checked anyway,
 * so a malformed manifest answers EIO instead of reading outside an array.
 */
#ifndef KSPEEDFS_FUSE_ENGINE_H
#define KSPEEDFS_FUSE_ENGINE_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "fuse_tier.h" /* FE_TOUCHED, FE_SERVED */

/* The manifest index: pointers into the arrays Python holds (kspeedfs/manifest/model.py). */
struct fe_index {
    uint64_t entries, chunks, extents, names_len, nfiles;
    uint64_t chunk_size, block_size, block_stride; /* stride: blocks per chunk */
    const uint32_t *parent, *mode, *uid, *gid;
    const uint64_t *size;
    const int64_t *mtime_ns;
    const uint64_t *name_off;
    const uint16_t *name_len;
    const uint64_t *data;
    const uint32_t *ext;
    const uint32_t *chunk_len;
    const uint8_t *names;
    const uint8_t *ext_digests;   /* 16 bytes per extent */
    const uint8_t *chunk_digests; /* 16 bytes per chunk */
    const uint8_t *block_digests; /* 8 bytes per block, block_stride per chunk (format 2) */
};

/* What the engine answers with, from the validated config. */
struct fe_options {
    uint64_t generation;    /* the dataset version */
    uint64_t dataset_bytes; /* for STATFS */
    double entry_timeout, attr_timeout;
    uint32_t blksize; /* st_blksize */
    int xattrs;       /* hand GETXATTR/LISTXATTR to Python; else ENOSYS */
    uint32_t max_background, congestion_threshold;
    uint32_t max_pages; /* pages per request (256 = 1 MiB) */
    uint32_t prefetch_depth, prefetch_trigger;
    int uring;            /* offer FUSE_OVER_IO_URING at INIT (if the kernel does) */
    uint32_t uring_depth; /* entries per queue (0 = FE_URING_DEPTH) */
    int splice;           /* large READ replies by vmsplice + splice (fuse_reply.c) */
    /* a paged manifest's map (manifest_pager.h): pages_failed(pages) is 1 once a page of
     * the index could not be loaded, and C then answers EIO. NULL: a whole manifest. */
    const void *pages;
    int (*pages_failed)(const void *pages);
};

/* A queued request for Python: one struct per kind, in a tagged union (a queue entry is
 * as large as the largest kind, GETXATTR's with its name, not their sum). READ, GETXATTR
 * and LISTXATTR are answered with fe_reply_* on ``fd``; the hints and events need none. */
enum fe_kind {
    FE_READ = 1,
    FE_GETXATTR = 2,
    FE_LISTXATTR = 3,
    FE_PREFETCH = 4,
    FE_FETCHED = 5
};

/* A READ C did not answer (a miss), or one Python hands back (fe_read_or_park). */
struct fe_read {
    int fd;          /* reply on this fd (the clone that read it); < 0: a ring token */
    int random;      /* not continuing the previous read of its handle */
    uint64_t unique; /* the kernel's id of the request */
    uint64_t entry;  /* manifest entry (inode - 1) */
    uint64_t offset, size;
    uint64_t t0; /* when it arrived (CLOCK_MONOTONIC ns; its latency) */
};

/* A GETXATTR or a LISTXATTR (the kind says which). */
struct fe_xattr {
    int fd;          /* as fe_read's */
    uint64_t unique; /* the kernel's id of the request */
    uint64_t entry;  /* manifest entry (inode - 1) */
    uint64_t size;   /* the caller's buffer size (0: it asks for the value's size) */
    uint64_t t0;     /* when it arrived (CLOCK_MONOTONIC ns; its latency) */
    char name[256];  /* GETXATTR: the attribute's name */
};

/* A sequential reader's chunks [first, stop) for Python to load (fuse_read.c do_read). */
struct fe_prefetch {
    uint64_t reached; /* the chunk the hinting READ reached */
    uint64_t entry;   /* the file's manifest entry (inode - 1) */
    uint64_t first, stop;
};

/* A native fetch that ended, or is late (fuse_fetch.h). Its slot, peer, path and start
 * are a C-started fetch's (cookie & FE_OWN); else 0, -1, 0, 0. */
struct fe_fetched {
    uint64_t cookie;
    uint64_t chunk; /* FE_NO_CHUNK: a part's (an extent's, a block's) posted by Python */
    int status;     /* FE_FETCH_OK, a WC status (< 64), or another FE_FETCH_* */
    int peer, path; /* the peer it read from, and which of its paths */
    uint64_t slot;  /* its landing slot's id (fetch_slot); a part's: the file's entry */
    uint64_t t0;    /* when it started (CLOCK_MONOTONIC ns) */
};

struct fe_request {
    int kind; /* enum fe_kind: which member of the union holds it */
    union {
        struct fe_read read;         /* FE_READ */
        struct fe_xattr xattr;       /* FE_GETXATTR, FE_LISTXATTR */
        struct fe_prefetch prefetch; /* FE_PREFETCH */
        struct fe_fetched fetched;   /* FE_FETCHED */
    };
};

/* Counters, per thread, summed on demand. Op slots follow enum fe_op. */
enum fe_op {
    FE_OP_LOOKUP,
    FE_OP_GETATTR,
    FE_OP_READLINK,
    FE_OP_OPEN,
    FE_OP_READ,
    FE_OP_RELEASE,
    FE_OP_OPENDIR,
    FE_OP_READDIR,
    FE_OP_RELEASEDIR,
    FE_OP_STATFS,
    FE_OP_FORGET,
    FE_OP_GETXATTR,
    FE_OP_LISTXATTR,
    FE_OP_EROFS,
    FE_OP_ENOSYS,
    FE_OP_OTHER,
    FE_NOPS
};
#define FE_BUCKETS 16 /* latency buckets: the bounds of boundary.OpStats, then the rest */

struct fe_counters {
    uint64_t count[FE_NOPS], errors[FE_NOPS], ns[FE_NOPS], buckets[FE_NOPS][FE_BUCKETS];
    uint64_t read_hits, read_hit_bytes, memory_hits, read_misses, queued, prefetch_hints;
    uint64_t late_hits;     /* READs that missed, answered from the tier in C on a second
                             * look once their chunks landed (fe_read_or_park: Python took
                             * them from the queue; or handed on from a parked list) */
    uint64_t resent;        /* requests the kernel sent again (FUSE_NOTIFY_RESEND) */
    uint64_t ring_requests; /* requests that came through an io_uring queue */
    uint64_t ring_copy_bytes, ring_copy_ns; /* READ hits copied into ring payloads */
    uint64_t ring_lost;                     /* entries whose commit the kernel refused */
    /* the solo gate (fuse_threads.c): times a /dev/fuse thread after the first waited at
     * it, and requests those threads read (the gate open: several tasks, or not readahead);
     * times it opened for a request of another task than the last, and for one of the
     * same task that was not readahead (not a READ, or a READ under FE_SOLO_READ) */
    uint64_t gate_waits, shared_requests, gate_opened_tasks, gate_opened_requests;
    uint64_t gate_crowded; /* windows the crowd rule began to keep it as it was */
    /* the native chunk fetch (fuse_fetch.h): READs posted, landed verified, failed or
     * stepped aside, READs parked on one in flight, parked READs answered or handed on */
    uint64_t fetch_posted, fetch_landed, fetch_failed, fetch_parked, fetch_answered;
    uint64_t fetch_started; /* of fetch_posted: started in C (fuse_fetch.h fetch_start) */
    uint64_t fetch_started_parts; /* of those, small files' extents (fetch_start_part) */
    uint64_t fetch_unkept;  /* of fetch_landed: extents answered, not kept (fetch_keep) */
    uint64_t fetch_tallied; /* of fetch_landed: parts told in a tally (FE_FETCH_TALLY) */
    uint64_t fetch_redundant;
    uint64_t spliced, spliced_bytes; /* READ replies sent by splice (fuse.splice) */
};

struct fe_engine;

/* Mounting (root: mount(2) with an fd of /dev/fuse; non-root callers use the pyfuse3
 * engine). Returns the fd, or -1 with ``err`` set. ``fe_unmount`` is umount2(MNT_DETACH):
 * the request threads then read ENODEV and end. */
int fe_mount(const char *path, const char *fsname, int allow_other, int nonempty,
             uint32_t max_read, char *err, size_t errlen);
int fe_unmount(const char *path);

/* Lifecycle. fe_create parses nothing: ``ix`` must point at arrays that outlive the
 * engine. ``fd`` is the /dev/fuse fd of a fresh mount; fe_init reads and answers INIT
 * on it (blocking). fe_start runs ``nthreads`` request threads; fe_join waits for them
 * to end (the caller unmounts or aborts the connection first). */
struct fe_engine *fe_create(int fd, const struct fe_index *ix, const struct fe_options *opt,
                            char *err, size_t errlen);
int fe_init(struct fe_engine *e, char *err, size_t errlen);
int fe_start(struct fe_engine *e, int nthreads, char *err, size_t errlen);
void fe_join(struct fe_engine *e);
void fe_destroy(struct fe_engine *e);
/* Upgrade (instead of fe_init): ``fd`` is a live connection another process negotiated;
 * take its INIT results as ours. */
void fe_adopt(struct fe_engine *e, uint32_t minor, uint64_t flags, uint32_t max_pages,
              uint32_t max_readahead);
/* Hand over to a successor reading the same connection: every request thread finishes
 * the request it holds and ends (a signal interrupts the ones waiting in read); returns
 * when they are joined. Nothing is unmounted or aborted; queued requests stay queued. */
int fe_stop(struct fe_engine *e); /* -EBUSY: io_uring queues (see fe_transport) */
/* Resume after a crash: the request threads read these fds (the dead daemon's master
 * and clones, kept open by the supervisor; ``fds[0]`` is the engine's fd) instead of
 * cloning new ones. Before fe_start; the engine owns them from then on. */
int fe_give_fds(struct fe_engine *e, const int *fds, int n);
/* The fds the request threads read (the supervisor keeps a copy of each). */
int fe_fds(const struct fe_engine *e, int *out, int max);
/* FUSE_NOTIFY_RESEND (kernel 6.9+): every request read from the connection and not yet
 * answered is queued again (its unique gets bit 63). 0, or -errno (-EINVAL: the kernel
 * does not know it). */
int fe_notify_resend(int fd);
int fe_eventfd(const struct fe_engine *e);
int fe_running(const struct fe_engine *e);
void fe_negotiated(const struct fe_engine *e, uint32_t *minor, uint64_t *flags,
                   uint32_t *max_pages, uint32_t *max_readahead);
/* How requests reach the engine: 1 = io_uring queues (every queue registered after INIT
 * negotiated FUSE_OVER_IO_URING), 0 = /dev/fuse reads. Valid after fe_start. An io_uring
 * engine cannot be handed over or resumed (fe_stop refuses it): the kernel binds a ring
 * entry to the buffers and task of the process that registered it (docs/design.md). */
int fe_transport(const struct fe_engine *e, const char **why); /* why: "" or the reason not */

/* The queue: up to ``max`` requests, oldest first (the eventfd is drained by Python). */
size_t fe_take(struct fe_engine *e, struct fe_request *out, size_t max);
/* Answer READ ``rd`` (one Python took from the queue, or a parked one handed back) from
 * the tier, or park it on one of its chunks in flight (1), else leave it to the caller (0). */
int fe_read_or_park(struct fe_engine *e, const struct fe_read *rd);

/* Replies to a queued request, on ``fd`` (a /dev/fuse fd, or a ring token: < 0). A
 * ring token's reply is copied into its entry and committed by the queue's thread; a
 * token whose engine or queue is gone, or whose entry holds another request: -ENOENT. */
int fe_reply_data(int fd, uint64_t unique, const void *buf, size_t len);
int fe_reply_iov(int fd, uint64_t unique, const void *const *bufs, const size_t *lens, int n);
int fe_reply_error(int fd, uint64_t unique, int err);
int fe_reply_xattr_size(int fd, uint64_t unique, uint32_t size);

/* The memory tier's verified buffers, by key (16-byte digest, or 20: digest + block).
 * ``owner`` is the binding's handle for the buffer; it comes back from fe_tier_discard
 * (0 references: release it now) or later from fe_tier_reap (a reply was still
 * writing from it). */
int fe_tier_put(struct fe_engine *e, const uint8_t *key, size_t keylen, const void *data,
                size_t len, void *owner);
/* Returns the owner if it may be released now, NULL if a reply still holds it (or
 * the key was not there). */
void *fe_tier_discard(struct fe_engine *e, const uint8_t *key, size_t keylen, int *found);
size_t fe_tier_reap(struct fe_engine *e, void **owners, size_t max);
/* Every owner, the table emptied (at teardown, threads joined). */
size_t fe_tier_clear(struct fe_engine *e, void **owners, size_t max);
size_t fe_tier_count(struct fe_engine *e);
/* tier_touched: whether the buffer under ``key`` has any of ``bits`` (fuse_tier.h):
 * FE_TOUCHED, read since the last such call (and cleared: the memory tier's LRU gives a
 * second chance to what C threads served); FE_SERVED, read at least once since its put. */
int fe_tier_touched(struct fe_engine *e, const uint8_t *key, size_t keylen, int bits);

/* FUSE_NOTIFY_STORE: put verified bytes of inode ``nodeid`` into the page cache. */
int fe_notify_store(int fd, uint64_t nodeid, uint64_t offset, const void *buf, size_t len);

void fe_counters(struct fe_engine *e, struct fe_counters *sum);

/* The calling thread replies for ``e``: large READ replies by splice if ``e``'s option
 * says so (request threads and the fetch thread call it as they start). fe_splice_room:
 * the largest reply (header included) one pipe of this process can carry, 0: none. */
void fe_reply_thread(struct fe_engine *e);
size_t fe_splice_room(void);

/* The native chunk fetch (fuse_fetch.h): started once, on the soft engine's C API; its
 * calls (fetch_engine, fetch_post, fetch_stop) on fe_fetcher's result. */
struct ks_capi;
struct fe_fetch;
int fe_fetch_enable(struct fe_engine *e, const struct ks_capi *api, char *err, size_t errlen);
struct fe_fetch *fe_fetcher(struct fe_engine *e);
/* The extent of file ``entry`` when it lies in one chunk (a small file): its digest and
 * length, 0; else -EINVAL. From the engine's own index. */
int fe_file_extent(struct fe_engine *e, uint64_t entry, const uint8_t **key, uint32_t *len);
/* Block ``block`` of chunk ``chunk``: its tier key (the chunk's digest, then ``block``
 * little-endian, as manifest/model.py block_key) and length, 0; else -EINVAL (no such block). */
int fe_chunk_block(struct fe_engine *e, uint64_t chunk, uint64_t block, uint8_t key[20],
                   uint32_t *len);

/* A FUSE io_uring request (the entry's header and ``payload``, ``payload_cap`` bytes) as
 * /dev/fuse would deliver it: fuse_in_header, the opcode's op_in, the payload, into
 * ``out`` (``cap`` bytes). Its length, or -EIO when the entry's sizes do not add up (they
 * are never trusted past ``cap`` and ``payload_cap``). Pure; native/fuzz feeds it garbage. */
struct fe_uring_req_header;
long fe_ring_layout(const struct fe_uring_req_header *hdr, const uint8_t *payload,
                    size_t payload_cap, uint8_t *out, size_t cap);

#endif
