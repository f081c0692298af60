/* manifest_pager.h — the page map of a paged manifest: the whole raw blob at one fixed
 * virtual address range, filled page by page on first touch (docs/design.md, "Paged
 * manifests", "The page map").
 *
 * The raw blob (kspeedfs/manifest/model.py) is cut into pages of ``page_size`` inflated
 * bytes (the last one shorter), each stored as a zlib stream in a content-addressed file
 * named by the SHA-256 of its inflated bytes:
 *
 *     <dir>/<first two hex chars>/<64 hex chars, lowercase>
 *
 * mp_open maps an anonymous private region of the blob's size (rounded up to the system
 * page size; MAP_NORESERVE) and registers it with a userfaultfd in MISSING mode. Handler
 * threads (C only: they never take the GIL, since the thread that faults may hold it)
 * read the fault messages, load the page from the first dir that has a valid copy (read,
 * inflate to exactly the page's length, SHA-256 equal to its entry in ``hashes``) and
 * UFFDIO_COPY the whole page into the region, which wakes every thread that faulted on
 * it. Readers of the region (the FUSE engine's index code, Python's ManifestIndex over a
 * memoryview) see one flat array and never know.
 *
 * A page no dir holds a valid copy of is a failure: the first one's message is kept
 * (mp_failure, one line naming the page's index and hash), the flag mp_failed is set
 * (sequentially consistent) *before* the page is filled with zeros, so the faulting
 * thread is not left waiting forever and, once it resumes, sees the flag if it looks.
 * The flag never clears: whoever reads through the map checks it after the read and
 * fails closed (EIO).
 *
 * Memory is bounded: at most max(1, cache_bytes / page_size) pages stay filled; beyond
 * that the oldest-filled page is dropped (MADV_DONTNEED) and faults again on its next
 * touch. Up to ``threads`` pages more may be in the middle of being filled.
 *
 * Privileges: the userfaultfd is made with full (kernel and user mode) fault handling
 * when the process may (root, CAP_SYS_PTRACE, or vm.unprivileged_userfaultfd=1); else
 * with UFFD_USER_MODE_ONLY, and then a kernel access of a page not yet filled (a
 * write(2) from the region, say) fails with EFAULT instead of waiting: user-space reads
 * (Python's, the engine's) are unaffected. mp_user_mode_only says which.
 *
 * Fork: the region is MADV_DONTFORK, so a forked child has no mapping there at all and a
 * touch is SIGSEGV. (Without it the child would keep an unregistered copy in which every
 * page not yet filled reads as zeros, silently.) A child must not use the map; it calls
 * mp_abandon, never mp_close.
 *
 * Threads: mp_open and mp_close from one thread; everything else from any thread, at
 * any time between them.
 */
#ifndef KSPEEDFS_MANIFEST_PAGER_H
#define KSPEEDFS_MANIFEST_PAGER_H

#include <stddef.h>
#include <stdint.h>

#define MP_HASH_LEN 32      /* SHA-256 */
#define MP_MAX_THREADS 64   /* handler threads */
#define MP_FAILURE_LEN 1024 /* the failure message, NUL included */

struct mp;

struct mp_config {
    size_t size;           /* the raw blob's bytes, > 0 */
    size_t page_size;      /* a multiple of the system page size */
    const uint8_t *hashes; /* MP_HASH_LEN per page, in page order (copied) */
    const char *const *dirs;
    size_t ndirs; /* tried in order (copied) */
    size_t cache_bytes;
    int threads; /* 1..MP_MAX_THREADS */
    /* The host's node's ask socket (kspeedfs/cluster/page_copy.py), or NULL: a page no
     * dir holds is asked of it (the page's hash, then its length as 8 bytes little
     * endian); the answer is one byte, 0 once the node has written the page to the first
     * dir, which is then tried again. Blocks the handler at most ask_ms for the connect,
     * the request and the answer each. */
    const char *ask;
    int ask_ms; /* 1..60000 with ask */
};

struct mp_stats {
    uint64_t faults;         /* fault messages handled (two faults on one page: two) */
    uint64_t fills;          /* pages filled with their verified bytes */
    uint64_t evictions;      /* pages dropped to stay within cache_bytes */
    uint64_t resident_pages; /* pages filled now (verified or zeros) */
    uint64_t failures;       /* pages filled with zeros: no dir held a valid copy */
    uint64_t fill_ns;        /* the fills' and failures' time, fault message to copied */
    /* the handlers' CPU time (their own, not the machine's) in the parts of a fill: the
     * page files' reads, inflates, SHA-256s (every dir tried), and the UFFDIO_COPYs */
    uint64_t read_ns, inflate_ns, sha_ns, copy_ns;
    uint64_t asks; /* pages asked of the node (mp_config.ask) */
    int user_mode_only;
};

/* Pages of a blob of ``size`` bytes: ceil(size / page_size). */
size_t mp_pages(size_t size, size_t page_size);

/* 0 and *out, or -errno with a one-line reason in ``why``: -EINVAL for a configuration
 * mp_pages or the limits above reject, -EPERM (and the like) when no userfaultfd could be
 * made in either mode, the errno of mmap, the handshake or registration otherwise. */
int mp_open(const struct mp_config *cfg, struct mp **out, char *why, size_t whylen);

/* Stops the handler threads, unregisters and unmaps the region, closes the descriptors
 * and frees ``m``. Nothing may read the region any more (the binding refuses while a
 * buffer over it is exported). */
void mp_close(struct mp *m);

/* In a forked child: frees ``m`` and the child's copies of its descriptors; neither
 * joins threads (the child has none of them) nor unmaps (the child has no mapping). */
void mp_abandon(struct mp *m);

void *mp_base(const struct mp *m); /* the region: mp_size bytes readable */
size_t mp_size(const struct mp *m);
int mp_user_mode_only(const struct mp *m);
/* 1 once a page could not be filled (sticky), else 0; a seq_cst load. */
int mp_failed(const struct mp *m);
/* The first failure's message, or NULL while mp_failed is 0. */
const char *mp_failure(const struct mp *m);
void mp_get_stats(const struct mp *m, struct mp_stats *st);

/* ------------------------------------------------------------------ the C API
 * For another extension module in the same process (the FUSE engine, to fail closed):
 * the capsule kspeedfs.manifest._pager._C_API holds one of these. ``hold`` (GIL held)
 * turns a kspeedfs.manifest._pager.PageMap object into its map and keeps it open (its
 * close() raises BufferError until ``release``, GIL held, is called as often); NULL with
 * a Python exception set when ``obj`` is not an open PageMap. The rest need no GIL. */
#define MP_CAPI_NAME "kspeedfs.manifest._pager._C_API"
#define MP_CAPI_ABI 1

struct mp_capi {
    int abi;                       /* MP_CAPI_ABI */
    struct mp *(*hold)(void *obj); /* obj: PyObject * */
    void (*release)(void *obj);
    int (*failed)(const struct mp *m);
    const char *(*failure)(const struct mp *m);
    void *(*base)(const struct mp *m);
    size_t (*size)(const struct mp *m);
};

#endif
