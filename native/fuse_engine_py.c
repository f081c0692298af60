/* fuse_engine_py.c — the CPython binding of the native FUSE engine: module
 * kspeedfs.fuse._engine (fuse_engine.h says what the engine does; kspeedfs/fuse/native.py
 * is its one user).
 *
 * Map of this file, top to bottom:
 *   helpers          raise_errno (OSError(errno, "<method>: <reason>")), int converters
 *   index            the manifest arrays: one Py_buffer per array, lengths checked, then
 *                    struct fe_index points into them
 *   tier owners      struct owner: the Py_buffer behind one memory-tier buffer
 *   Engine           lifecycle (init, start, join, close), tier, counters
 *   module           mount, unmount, reply*, notify_store, constants
 * fuse_events_py.c has take() and the named type of each kind it returns;
 * fuse_fetch_py.c, the native fetch's methods of Engine and the Block type;
 * fuse_engine_py.h, what crosses the files.
 *
 * The GIL. Released around every call that blocks or writes to /dev/fuse: fe_mount,
 * fe_unmount, fe_init (waits for the kernel's INIT), fe_join (waits for the threads),
 * the fe_reply_* writes and fe_notify_store. Kept for the short ones, each one mutex at
 * most: fe_take, fe_tier_*, fe_counters, fe_start. The engine's request threads never
 * take it (they touch no Python object), so nothing here waits on them with it held.
 *
 * Who owns what.
 *   - The Engine object holds a Py_buffer on every index array for its whole life: the
 *     threads read them without the GIL, so the arrays stay alive and unmoved until the
 *     engine is destroyed. fe_create copies struct fe_index / fe_options themselves.
 *   - The /dev/fuse fd belongs to the caller until Engine() succeeds, then to the
 *     engine (fe_destroy closes it).
 *   - A memory-tier buffer is an owner (PyMem_Malloc'd, one Py_buffer). tier_put hands
 *     it to the engine; it comes back, to be released, only when no reply points into it:
 *     from tier_discard (no reply was writing from it) or from reap() (the last reply
 *     finished later, or tier_put replaced it), or from close() (threads joined).
 *   - Replies (reply, notify_store) hold their Py_buffers only for the write.
 *
 * Teardown: close() needs the request threads gone (unmount, then join); it refuses
 * with EBUSY while they run. An Engine collected while they still run is leaked on
 * purpose, with its buffers: freeing memory a thread may read is worse than a leak.
 * Any method on a closed engine raises OSError(EBADF); close() itself is idempotent.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include "fuse_engine_py.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <string.h>

#include "manifest_pager.h"
#include "py_errno.h"

#define MAX_IOV 64      /* fe_reply_iov's limit; more parts are joined into one */
#define OWNER_BATCH 256 /* owners per fe_tier_reap / fe_tier_clear call */

/* ------------------------------------------------------------------------ helpers */

/* The engine's message if it wrote one, else strerror(err). */
const char *reason(const char *err, int errnum) { return err[0] ? err : strerror(errnum); }

/* O& converters: Python ints into u64 / u32, with range checks (no silent wrap). */
static int conv_u64(PyObject *o, void *out)
{
    PyObject *i = PyNumber_Index(o);
    if (!i)
        return 0;
    unsigned long long v = PyLong_AsUnsignedLongLong(i);
    Py_DECREF(i);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return 0;
    *(uint64_t *)out = v;
    return 1;
}

static int conv_u32(PyObject *o, void *out)
{
    uint64_t v;
    if (!conv_u64(o, &v))
        return 0;
    if (v > UINT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "value does not fit in 32 bits");
        return 0;
    }
    *(uint32_t *)out = (uint32_t)v;
    return 1;
}

/* ---------------------------------------------------------------------------- index */

enum per { PER_ENTRY, PER_CHUNK, PER_EXTENT, PER_BLOCK, PER_ANY };

/* The buffer attributes of ManifestIndex, in enum order: what each counts, bytes per item
 * (also the alignment the engine's loads need). */
static const struct ix_array {
    const char *name;
    enum per per;
    unsigned width;
} IX_ARRAYS[IX_N] = {
    [IX_PARENT] = {"parent", PER_ENTRY, 4},
    [IX_MODE] = {"mode", PER_ENTRY, 4},
    [IX_UID] = {"uid", PER_ENTRY, 4},
    [IX_GID] = {"gid", PER_ENTRY, 4},
    [IX_SIZE] = {"size", PER_ENTRY, 8},
    [IX_MTIME_NS] = {"mtime_ns", PER_ENTRY, 8},
    [IX_NAME_OFF] = {"name_off", PER_ENTRY, 8},
    [IX_NAME_LEN] = {"name_len", PER_ENTRY, 2},
    [IX_DATA] = {"data", PER_ENTRY, 8},
    [IX_EXT] = {"ext", PER_ENTRY, 4},
    [IX_CHUNK_LEN] = {"chunk_len", PER_CHUNK, 4},
    [IX_NAMES] = {"names", PER_ANY, 1},
    [IX_EXT_DIGESTS] = {"ext_digests", PER_EXTENT, 16},
    [IX_CHUNK_DIGESTS] = {"chunk_digests", PER_CHUNK, 16},
    [IX_BLOCK_DIGESTS] = {"block_digests", PER_BLOCK, 8},
};

static void views_release(EngineObject *self)
{
    while (self->nviews > 0)
        PyBuffer_Release(&self->views[--self->nviews]);
}

/* index.<name> as an unsigned integer. */
static int index_int(PyObject *index, const char *name, uint64_t *out)
{
    PyObject *o = PyObject_GetAttrString(index, name);
    if (!o)
        return -1;
    int ok = conv_u64(o, out);
    Py_DECREF(o);
    return ok ? 0 : -1;
}

static int index_counts(PyObject *index, struct fe_index *ix)
{
    if (index_int(index, "entries", &ix->entries) < 0 ||
        index_int(index, "chunks", &ix->chunks) < 0 ||
        index_int(index, "extents", &ix->extents) < 0 ||
        index_int(index, "nfiles", &ix->nfiles) < 0 ||
        index_int(index, "chunk_size", &ix->chunk_size) < 0 ||
        index_int(index, "block_size", &ix->block_size) < 0)
        return -1;
    uint64_t bs = ix->block_size;
    ix->block_stride = bs ? ix->chunk_size / bs + (ix->chunk_size % bs != 0) : 0;
    return 0;
}

/* The length and alignment array ``i`` must have. */
static int index_check(const Py_buffer *v, const struct ix_array *a, const struct fe_index *ix)
{
    if (a->per != PER_ANY) {
        uint64_t count = a->per == PER_ENTRY   ? ix->entries
                         : a->per == PER_CHUNK ? ix->chunks
                         : a->per == PER_BLOCK ? 0
                                               : ix->extents;
        uint64_t expected;
        if ((a->per == PER_BLOCK &&
             __builtin_mul_overflow(ix->chunks, ix->block_stride, &count)) ||
            __builtin_mul_overflow(count, (uint64_t)a->width, &expected)) {
            PyErr_Format(PyExc_ValueError, "index: %s: %llu items of %u bytes overflow",
                         a->name, (unsigned long long)count, a->width);
            return -1;
        }
        if ((uint64_t)v->len != expected) {
            PyErr_Format(PyExc_ValueError, "index: %s has %zd bytes, expected %llu", a->name,
                         v->len, (unsigned long long)expected);
            return -1;
        }
    }
    if (a->width <= 8 && (uintptr_t)v->buf % a->width) {
        PyErr_Format(PyExc_ValueError, "index: %s is not %u-byte aligned", a->name, a->width);
        return -1;
    }
    return 0;
}

/* Hold index.<array i> in self->views[i] (the next free one) and check it. */
static int index_view(EngineObject *self, PyObject *index, int i, const struct fe_index *ix)
{
    const struct ix_array *a = &IX_ARRAYS[i];
    PyObject *o = PyObject_GetAttrString(index, a->name);
    if (!o)
        return -1;
    int rc = PyObject_GetBuffer(o, &self->views[i], PyBUF_C_CONTIGUOUS | PyBUF_FORMAT);
    Py_DECREF(o); /* the view holds its own reference to the exporter */
    if (rc < 0)
        return -1;
    self->nviews = i + 1;
    return index_check(&self->views[i], a, ix);
}

static void index_point(const EngineObject *self, struct fe_index *ix)
{
    const Py_buffer *v = self->views;
    ix->parent = v[IX_PARENT].buf;
    ix->mode = v[IX_MODE].buf;
    ix->uid = v[IX_UID].buf;
    ix->gid = v[IX_GID].buf;
    ix->size = v[IX_SIZE].buf;
    ix->mtime_ns = v[IX_MTIME_NS].buf;
    ix->name_off = v[IX_NAME_OFF].buf;
    ix->name_len = v[IX_NAME_LEN].buf;
    ix->data = v[IX_DATA].buf;
    ix->ext = v[IX_EXT].buf;
    ix->chunk_len = v[IX_CHUNK_LEN].buf;
    ix->names = v[IX_NAMES].buf;
    ix->names_len = (uint64_t)v[IX_NAMES].len;
    ix->ext_digests = v[IX_EXT_DIGESTS].buf;
    ix->chunk_digests = v[IX_CHUNK_DIGESTS].buf;
    ix->block_digests = v[IX_BLOCK_DIGESTS].buf;
}

/* Fill ``ix`` from a ManifestIndex, holding its arrays in self; on error, nothing held. */
static int index_load(EngineObject *self, PyObject *index, struct fe_index *ix)
{
    memset(ix, 0, sizeof *ix);
    if (index_counts(index, ix) < 0)
        return -1;
    for (int i = 0; i < IX_N; i++)
        if (index_view(self, index, i, ix) < 0) {
            views_release(self);
            return -1;
        }
    index_point(self, ix);
    return 0;
}

/* ----------------------------------------------------------------------- tier owners */

struct owner {
    Py_buffer view; /* holds the exporter: the bytes stay alive and unmoved */
};

static void owner_release(void *p)
{
    struct owner *o = p;
    if (!o)
        return;
    PyBuffer_Release(&o->view);
    PyMem_Free(o);
}

/* Release every owner ``take`` (fe_tier_reap or fe_tier_clear) hands back. */
static size_t owners_drain(struct fe_engine *e,
                           size_t (*take)(struct fe_engine *, void **, size_t))
{
    void *owners[OWNER_BATCH];
    size_t n, total = 0;
    while ((n = take(e, owners, OWNER_BATCH)) > 0) {
        for (size_t i = 0; i < n; i++)
            owner_release(owners[i]);
        total += n;
    }
    return total;
}

/* A tier key: a 16-byte digest, or 20 (digest + block number). */
static int check_key(Py_ssize_t keylen, const char *what)
{
    if (keylen == 16 || keylen == 20)
        return 0;
    PyErr_Format(PyExc_ValueError, "%s: key has %zd bytes, expected 16 or 20", what, keylen);
    return -1;
}

/* ------------------------------------------------------------------------- engine */

struct fe_engine *engine_of(EngineObject *self, const char *what)
{
    if (!self->e)
        raise_errno(EBADF, "%s: engine closed", what);
    return self->e;
}

/* The engine for a lifecycle call, which must not overlap init or join. */
static struct fe_engine *engine_idle(EngineObject *self, const char *what)
{
    struct fe_engine *e = engine_of(self, what);
    if (e && self->busy) {
        raise_errno(EBUSY, "%s: init or join in progress", what);
        return NULL;
    }
    return e;
}

/* Threads gone: join them (they may still be returning), release every tier owner,
 * destroy the engine, drop the index arrays. The pointer is cleared first: while the
 * GIL is released nobody else can reach the engine. */
/* ---------------------------------------------------------------- a paged manifest */

static const struct mp_capi *pages_capi; /* the page map's C API: one per process */

static int pages_failed(const void *map) { return pages_capi->failed(map); }

/* Hold ``pages`` (a kspeedfs.manifest.pager PageMap's native map, or None) for the
 * engine's life and point ``opt`` at its failure flag. */
static int pages_hold(EngineObject *self, PyObject *pages, struct fe_options *opt)
{
    if (pages == Py_None)
        return 0;
    if (!pages_capi) {
        const struct mp_capi *capi = PyCapsule_Import(MP_CAPI_NAME, 0);
        if (!capi)
            return -1;
        if (capi->abi != MP_CAPI_ABI) {
            PyErr_SetString(PyExc_ImportError, "engine: the page map's C API is another ABI");
            return -1;
        }
        pages_capi = capi;
    }
    struct mp *m = pages_capi->hold(pages);
    if (!m)
        return -1;
    Py_INCREF(pages);
    self->pages = pages;
    opt->pages = m;
    opt->pages_failed = pages_failed;
    return 0;
}

static void pages_release(EngineObject *self)
{
    if (!self->pages)
        return;
    pages_capi->release(self->pages);
    Py_CLEAR(self->pages);
}

static void engine_teardown(EngineObject *self)
{
    struct fe_engine *e = self->e;
    self->e = NULL;
    Py_BEGIN_ALLOW_THREADS
    fe_join(e);
    Py_END_ALLOW_THREADS
    fetch_release(self, e, 0);
    owners_drain(e, fe_tier_clear);
    fe_destroy(e);
    views_release(self);
    pages_release(self);
}

static void Engine_dealloc(EngineObject *self)
{
    if (self->e && fe_running(self->e)) {
        /* threads still read the arrays and the tier: leak it all rather than free it */
        self->e = NULL;
        self->nviews = 0;
        self->pages = NULL;
    } else if (self->e) {
        engine_teardown(self);
    }
    views_release(self);
    pages_release(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int check_timeouts(const struct fe_options *opt)
{
    if (!isfinite(opt->entry_timeout) || opt->entry_timeout < 0 ||
        !isfinite(opt->attr_timeout) || opt->attr_timeout < 0) {
        PyErr_SetString(PyExc_ValueError, "engine: timeouts must be finite and >= 0");
        return -1;
    }
    return 0;
}

/* Engine(fd, index, *, generation, dataset_bytes, entry_timeout, attr_timeout, blksize,
 *        xattrs, max_background, congestion_threshold, max_pages, prefetch_depth,
 *        prefetch_trigger, uring, uring_depth, splice, pages): 0 for a count means the
 *        engine's default; uring: offer FUSE over io_uring at INIT (the kernel decides);
 *        splice: large READ replies by vmsplice + splice; pages: the PageMap behind a
 *        paged index (its failure makes every C answer EIO), or None. */
static int Engine_init(EngineObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"fd",
                             "index",
                             "generation",
                             "dataset_bytes",
                             "entry_timeout",
                             "attr_timeout",
                             "blksize",
                             "xattrs",
                             "max_background",
                             "congestion_threshold",
                             "max_pages",
                             "prefetch_depth",
                             "prefetch_trigger",
                             "uring",
                             "uring_depth",
                             "splice",
                             "pages",
                             NULL};
    int fd;
    PyObject *index, *pages = Py_None;
    struct fe_options opt = {.entry_timeout = 1.0, .attr_timeout = 1.0, .prefetch_trigger = 2};
    struct fe_index ix;
    char err[256] = "";
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iO|$O&O&ddO&pO&O&O&O&O&pO&pO:Engine", kwlist,
                                     &fd, &index, conv_u64, &opt.generation, conv_u64,
                                     &opt.dataset_bytes, &opt.entry_timeout, &opt.attr_timeout,
                                     conv_u32, &opt.blksize, &opt.xattrs, conv_u32,
                                     &opt.max_background, conv_u32, &opt.congestion_threshold,
                                     conv_u32, &opt.max_pages, conv_u32, &opt.prefetch_depth,
                                     conv_u32, &opt.prefetch_trigger, &opt.uring, conv_u32,
                                     &opt.uring_depth, &opt.splice, &pages))
        return -1;
    if (self->e || self->nviews || self->pages) {
        PyErr_SetString(PyExc_RuntimeError, "Engine already initialised");
        return -1;
    }
    if (fd < 0) {
        raise_errno(EBADF, "engine: bad fd %d", fd);
        return -1;
    }
    if (check_timeouts(&opt) < 0 || pages_hold(self, pages, &opt) < 0)
        return -1;
    if (index_load(self, index, &ix) < 0) {
        pages_release(self);
        return -1;
    }
    errno = 0;
    struct fe_engine *e = fe_create(fd, &ix, &opt, err, sizeof err);
    int saved = errno ? errno : EINVAL;
    if (!e) {
        views_release(self);
        pages_release(self);
        raise_errno(saved, "engine: %s", reason(err, saved));
        return -1;
    }
    self->e = e;
    return 0;
}

/* init(): read and answer the kernel's INIT (blocks until it comes). */
static PyObject *Engine_init_fuse(EngineObject *self, PyObject *unused)
{
    char err[256] = "";
    int rc;
    struct fe_engine *e = engine_idle(self, "init");
    if (!e)
        return NULL;
    if (self->initialised)
        return raise_errno(EALREADY, "init: already done");
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    rc = fe_init(e, err, sizeof err);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    if (rc < 0)
        return raise_errno(-rc, "init: %s", reason(err, -rc));
    self->initialised = 1;
    Py_RETURN_NONE;
}

/* adopt(minor, flags, max_pages, max_readahead): instead of init() on a connection a
 * predecessor negotiated (an upgrade: its INIT results come with the fd). */
static PyObject *Engine_adopt(EngineObject *self, PyObject *args)
{
    unsigned int minor, max_pages, max_readahead;
    unsigned long long flags;
    if (!PyArg_ParseTuple(args, "IKII:adopt", &minor, &flags, &max_pages, &max_readahead))
        return NULL;
    struct fe_engine *e = engine_idle(self, "adopt");
    if (!e)
        return NULL;
    if (self->initialised)
        return raise_errno(EALREADY, "adopt: already initialised");
    fe_adopt(e, minor, flags, max_pages, max_readahead);
    self->initialised = 1;
    Py_RETURN_NONE;
}

/* give_fds([fd, ...]): the request threads read these (a resume: fds[0] is the engine's) */
static PyObject *Engine_give_fds(EngineObject *self, PyObject *arg)
{
    int fds[256];
    PyObject *seq = PySequence_Fast(arg, "give_fds: a sequence of fds");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n < 1 || n > 256) {
        Py_DECREF(seq);
        return raise_errno(EINVAL, "give_fds: 1..256 fds");
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
        if (v == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return NULL;
        }
        fds[i] = (int)v;
    }
    Py_DECREF(seq);
    struct fe_engine *e = engine_idle(self, "give_fds");
    if (!e)
        return NULL;
    int rc = fe_give_fds(e, fds, (int)n);
    if (rc < 0)
        return raise_errno(-rc, "give_fds: the first must be the engine's fd, before start");
    Py_RETURN_NONE;
}

/* fds() -> [fd, ...]: what the request threads read */
static PyObject *Engine_fds(EngineObject *self, PyObject *unused)
{
    int fds[256];
    struct fe_engine *e = engine_of(self, "fds");
    if (!e)
        return NULL;
    int n = fe_fds(e, fds, 256);
    PyObject *out = PyList_New(n);
    for (int i = 0; out && i < n; i++)
        PyList_SET_ITEM(out, i, PyLong_FromLong(fds[i]));
    return out;
}

/* stop(): hand over to a successor: the request threads end (GIL released), joined. */
static PyObject *Engine_stop(EngineObject *self, PyObject *unused)
{
    struct fe_engine *e = engine_idle(self, "stop");
    if (!e)
        return NULL;
    int rc;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    rc = fe_stop(e);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    if (rc < 0)
        return raise_errno(-rc, "stop: this engine serves io_uring queues, which cannot be "
                                "handed over");
    Py_RETURN_NONE;
}

/* transport() -> ("io_uring" | "/dev/fuse", why): how requests reach the engine, and
 * why not io_uring when INIT negotiated it ("" otherwise). */
static PyObject *Engine_transport(EngineObject *self, PyObject *unused)
{
    const char *why = "";
    struct fe_engine *e = engine_of(self, "transport");
    if (!e)
        return NULL;
    int t = fe_transport(e, &why);
    return Py_BuildValue("(ss)", t ? "io_uring" : "/dev/fuse", why);
}

/* start(nthreads): the request threads. */
static PyObject *Engine_start(EngineObject *self, PyObject *args)
{
    int nthreads;
    char err[256] = "";
    if (!PyArg_ParseTuple(args, "i:start", &nthreads))
        return NULL;
    struct fe_engine *e = engine_idle(self, "start");
    if (!e)
        return NULL;
    if (!self->initialised)
        return raise_errno(EINVAL, "start: init() first");
    if (self->started)
        return raise_errno(EALREADY, "start: already started");
    int rc = fe_start(e, nthreads, err, sizeof err);
    if (rc < 0)
        return raise_errno(-rc, "start: %s", reason(err, -rc));
    self->started = 1;
    Py_RETURN_NONE;
}

/* join(): wait for the request threads (they end once the mount is gone). */
static PyObject *Engine_join(EngineObject *self, PyObject *unused)
{
    struct fe_engine *e = engine_idle(self, "join");
    if (!e)
        return NULL;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    fe_join(e);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    Py_RETURN_NONE;
}

/* close(): after join; releases every tier buffer and the index. Idempotent. */
static PyObject *Engine_close(EngineObject *self, PyObject *unused)
{
    if (!self->e)
        Py_RETURN_NONE;
    if (!engine_idle(self, "close"))
        return NULL;
    if (fe_running(self->e))
        return raise_errno(EBUSY, "close: request threads running (unmount, then join)");
    engine_teardown(self);
    Py_RETURN_NONE;
}

static PyObject *Engine_eventfd(EngineObject *self, void *closure)
{
    struct fe_engine *e = engine_of(self, "eventfd");
    return e ? PyLong_FromLong(fe_eventfd(e)) : NULL;
}

static PyObject *Engine_running(EngineObject *self, void *closure)
{
    struct fe_engine *e = engine_of(self, "running");
    return e ? PyBool_FromLong(fe_running(e)) : NULL;
}

/* negotiated() -> (minor, flags, max_pages, max_readahead): what INIT settled. */
static PyObject *Engine_negotiated(EngineObject *self, PyObject *unused)
{
    uint32_t minor, max_pages, max_readahead;
    uint64_t flags;
    struct fe_engine *e = engine_of(self, "negotiated");
    if (!e)
        return NULL;
    fe_negotiated(e, &minor, &flags, &max_pages, &max_readahead);
    return Py_BuildValue("(IKII)", minor, (unsigned long long)flags, max_pages, max_readahead);
}

/* ---------------------------------------------------------------------- memory tier */

/* tier_put(key, data): the engine answers READs of ``key`` from ``data`` in place. */
static PyObject *Engine_tier_put(EngineObject *self, PyObject *args)
{
    const char *key;
    Py_ssize_t keylen;
    PyObject *data;
    if (!PyArg_ParseTuple(args, "y#O:tier_put", &key, &keylen, &data) ||
        check_key(keylen, "tier_put") < 0)
        return NULL;
    struct owner *o = PyMem_Malloc(sizeof *o);
    if (!o)
        return PyErr_NoMemory();
    if (PyObject_GetBuffer(data, &o->view, PyBUF_SIMPLE) < 0) {
        PyMem_Free(o);
        return NULL;
    }
    struct fe_engine *e = engine_of(self, "tier_put"); /* after any exporter code ran */
    int rc = e ? fe_tier_put(e, (const uint8_t *)key, (size_t)keylen, o->view.buf,
                             (size_t)o->view.len, o)
               : -EBADF;
    if (rc < 0) {
        owner_release(o);
        return e ? raise_errno(-rc, "tier_put: %s", strerror(-rc)) : NULL;
    }
    Py_RETURN_NONE;
}

/* tier_discard(key) -> bool (was it there); its buffer is released now or by reap(). */
static PyObject *Engine_tier_discard(EngineObject *self, PyObject *args)
{
    const char *key;
    Py_ssize_t keylen;
    int found = 0;
    if (!PyArg_ParseTuple(args, "y#:tier_discard", &key, &keylen) ||
        check_key(keylen, "tier_discard") < 0)
        return NULL;
    struct fe_engine *e = engine_of(self, "tier_discard");
    if (!e)
        return NULL;
    owner_release(fe_tier_discard(e, (const uint8_t *)key, (size_t)keylen, &found));
    return PyBool_FromLong(found);
}

/* tier_touched(key, served=False) -> bool: served by a C thread since the last call
 * (and cleared); with served=True: served at least once since the put (not cleared). */
static PyObject *Engine_tier_touched(EngineObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"key", "served", NULL};
    const char *key;
    Py_ssize_t keylen;
    int served = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y#|p:tier_touched", kwlist, &key, &keylen,
                                     &served) ||
        check_key(keylen, "tier_touched") < 0)
        return NULL;
    struct fe_engine *e = engine_of(self, "tier_touched");
    if (!e)
        return NULL;
    return PyBool_FromLong(fe_tier_touched(e, (const uint8_t *)key, (size_t)keylen,
                                           served ? FE_SERVED : FE_TOUCHED));
}

/* reap() -> int: release the buffers the last reply from them has retired. */
static PyObject *Engine_reap(EngineObject *self, PyObject *unused)
{
    struct fe_engine *e = engine_of(self, "reap");
    return e ? PyLong_FromSize_t(owners_drain(e, fe_tier_reap)) : NULL;
}

static PyObject *Engine_tier_count(EngineObject *self, void *closure)
{
    struct fe_engine *e = engine_of(self, "tier_count");
    return e ? PyLong_FromSize_t(fe_tier_count(e)) : NULL;
}

/* ------------------------------------------------------------------------- counters */

static const char *const OP_NAMES[FE_NOPS] = {
    [FE_OP_LOOKUP] = "lookup",
    [FE_OP_GETATTR] = "getattr",
    [FE_OP_READLINK] = "readlink",
    [FE_OP_OPEN] = "open",
    [FE_OP_READ] = "read",
    [FE_OP_RELEASE] = "release",
    [FE_OP_OPENDIR] = "opendir",
    [FE_OP_READDIR] = "readdir",
    [FE_OP_RELEASEDIR] = "releasedir",
    [FE_OP_STATFS] = "statfs",
    [FE_OP_FORGET] = "forget",
    [FE_OP_EROFS] = "erofs",
    [FE_OP_GETXATTR] = "getxattr",
    [FE_OP_LISTXATTR] = "listxattr",
    [FE_OP_ENOSYS] = "enosys",
    [FE_OP_OTHER] = "other",
};

/* (count, errors, seconds, [bucket counts]) of one op */
static PyObject *op_tuple(const struct fe_counters *c, int op)
{
    PyObject *buckets = PyList_New(FE_BUCKETS);
    for (int b = 0; buckets && b < FE_BUCKETS; b++) {
        PyObject *v = PyLong_FromUnsignedLongLong(c->buckets[op][b]);
        if (!v) {
            Py_CLEAR(buckets);
            break;
        }
        PyList_SET_ITEM(buckets, b, v);
    }
    if (!buckets)
        return NULL;
    return Py_BuildValue("(KKdN)", (unsigned long long)c->count[op],
                         (unsigned long long)c->errors[op], (double)c->ns[op] / 1e9, buckets);
}

static PyObject *ops_dict(const struct fe_counters *c)
{
    PyObject *ops = PyDict_New();
    for (int op = 0; ops && op < FE_NOPS; op++) {
        PyObject *t = op_tuple(c, op);
        if (!t || PyDict_SetItemString(ops, OP_NAMES[op], t) < 0)
            Py_CLEAR(ops);
        Py_XDECREF(t);
    }
    return ops;
}

/* counters() -> {"ops": {name: (count, errors, seconds, buckets)}, "read_hits": ...} */
static PyObject *Engine_counters(EngineObject *self, PyObject *unused)
{
    struct fe_counters c;
    struct fe_engine *e = engine_of(self, "counters");
    if (!e)
        return NULL;
    fe_counters(e, &c);
    PyObject *ops = ops_dict(&c);
    if (!ops)
        return NULL;
    return Py_BuildValue(
        "{s:N,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,"
        "s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K}",
        "ops", ops, "read_hits", (unsigned long long)c.read_hits, "read_hit_bytes",
        (unsigned long long)c.read_hit_bytes, "memory_hits", (unsigned long long)c.memory_hits,
        "read_misses", (unsigned long long)c.read_misses, "late_hits",
        (unsigned long long)c.late_hits, "queued", (unsigned long long)c.queued,
        "prefetch_hints", (unsigned long long)c.prefetch_hints, "resent",
        (unsigned long long)c.resent, "ring_requests", (unsigned long long)c.ring_requests,
        "ring_copy_bytes", (unsigned long long)c.ring_copy_bytes, "spliced",
        (unsigned long long)c.spliced, "spliced_bytes", (unsigned long long)c.spliced_bytes,
        "ring_copy_ns", (unsigned long long)c.ring_copy_ns, "ring_lost",
        (unsigned long long)c.ring_lost, "gate_waits", (unsigned long long)c.gate_waits,
        "shared_requests", (unsigned long long)c.shared_requests, "gate_opened_tasks",
        (unsigned long long)c.gate_opened_tasks, "gate_opened_requests",
        (unsigned long long)c.gate_opened_requests, "gate_crowded",
        (unsigned long long)c.gate_crowded, "fetch_posted", (unsigned long long)c.fetch_posted,
        "fetch_landed", (unsigned long long)c.fetch_landed, "fetch_failed",
        (unsigned long long)c.fetch_failed, "fetch_redundant",
        (unsigned long long)c.fetch_redundant, "fetch_parked",
        (unsigned long long)c.fetch_parked, "fetch_answered",
        (unsigned long long)c.fetch_answered, "fetch_started",
        (unsigned long long)c.fetch_started, "fetch_started_parts",
        (unsigned long long)c.fetch_started_parts, "fetch_unkept",
        (unsigned long long)c.fetch_unkept, "fetch_tallied",
        (unsigned long long)c.fetch_tallied);
}

/* ------------------------------------------------------------------ the Engine type */

static PyMethodDef Engine_methods[] = {
    {"init", (PyCFunction)Engine_init_fuse, METH_NOARGS,
     "init(): read and answer the kernel's INIT (blocking, GIL released)"},
    {"start", (PyCFunction)Engine_start, METH_VARARGS, "start(nthreads): the request threads"},
    {"adopt", (PyCFunction)Engine_adopt, METH_VARARGS,
     "adopt(minor, flags, max_pages, max_readahead): a predecessor's INIT, instead of init()"},
    {"give_fds", (PyCFunction)Engine_give_fds, METH_O,
     "give_fds(fds): the request threads read these (resume after a crash), before start"},
    {"fds", (PyCFunction)Engine_fds, METH_NOARGS, "fds(): the fds the request threads read"},
    {"transport", (PyCFunction)Engine_transport, METH_NOARGS,
     "transport() -> ('io_uring' | '/dev/fuse', why not io_uring)"},
    {"stop", (PyCFunction)Engine_stop, METH_NOARGS,
     "stop(): the request threads end for a successor (nothing unmounted), joined"},
    {"join", (PyCFunction)Engine_join, METH_NOARGS,
     "join(): wait for the request threads to end (after unmount)"},
    {"close", (PyCFunction)Engine_close, METH_NOARGS,
     "close(): after join; release every tier buffer and the index (idempotent)"},
    {"negotiated", (PyCFunction)Engine_negotiated, METH_NOARGS,
     "negotiated() -> (minor, flags, max_pages, max_readahead)"},
    {"take", (PyCFunction)Engine_take, METH_VARARGS,
     "take(max=256) -> [Read | Getxattr | Listxattr | Prefetch | Fetched], oldest first "
     "(one named type per kind; ``since``: time.monotonic's clock)"},
    {"tier_put", (PyCFunction)Engine_tier_put, METH_VARARGS,
     "tier_put(key, data): serve READs of key (16 or 20 bytes) from data, in place"},
    {"tier_discard", (PyCFunction)Engine_tier_discard, METH_VARARGS,
     "tier_discard(key) -> bool: remove key; its buffer is released now or by reap()"},
    {"tier_touched", (PyCFunction)(void (*)(void))Engine_tier_touched,
     METH_VARARGS | METH_KEYWORDS,
     "tier_touched(key, served=False) -> bool: served since the last call (and cleared); "
     "served=True: served at least once since the put (not cleared)"},
    {"reap", (PyCFunction)Engine_reap, METH_NOARGS,
     "reap() -> int: release the buffers no reply points into any more"},
    {"counters", (PyCFunction)Engine_counters, METH_NOARGS, "counters() -> dict"},
    {"fetch_enable", (PyCFunction)Engine_fetch_enable, METH_O,
     "fetch_enable(capsule): the native chunk fetch, on rdma._soft_engine._C_API"},
    {"fetch_engine", (PyCFunction)Engine_fetch_engine, METH_O,
     "fetch_engine(soft_engine) -> handle: a fetch CQ there (held until fetch_stop)"},
    {"fetch_post_extent", (PyCFunction)Engine_fetch_post_extent, METH_VARARGS,
     "fetch_post_extent(handle, qpn, entry, cookie, laddr, lkey, raddr, rkey, read=None)"},
    {"fetch_post_block", (PyCFunction)Engine_fetch_post_block, METH_VARARGS,
     "fetch_post_block(handle, qpn, entry, chunk, block, digest, cookie, laddr, lkey, raddr, "
     "rkey, read=None)"},
    {"read_or_park", (PyCFunction)Engine_read_or_park, METH_VARARGS,
     "read_or_park(entry, read) -> bool: a queued READ answered from the tier or parked in C"},
    {"fetch_landed", (PyCFunction)Engine_fetch_landed, METH_O,
     "fetch_landed(cookie) -> Block | None: the buffer an extent's fetch put in the tier"},
    {"fetch_post", (PyCFunction)Engine_fetch_post, METH_VARARGS,
     "fetch_post(handle, qpn, chunk, cookie, laddr, lkey, raddr, rkey, length)"},
    {"fetch_peer", (PyCFunction)Engine_fetch_peer, METH_VARARGS,
     "fetch_peer(peer, [(handle, qpn, raddr, rkey, nic)...], limit_ns, part_limits=()): a "
     "peer's UP paths and hedging limits"},
    {"fetch_staging", (PyCFunction)Engine_fetch_staging, METH_VARARGS,
     "fetch_staging(laddr, size, lkeys) -> bool: a staging slot for the extents C starts"},
    {"fetch_route", (PyCFunction)Engine_fetch_route, METH_VARARGS,
     "fetch_route(chunk, peer, offset): where the chunk lies (peer -1: no route)"},
    {"fetch_unroute", (PyCFunction)Engine_fetch_unroute, METH_NOARGS,
     "fetch_unroute(): every route and peer forgotten"},
    {"fetch_slot", (PyCFunction)Engine_fetch_slot, METH_VARARGS,
     "fetch_slot(id, laddr, lkeys) -> bool: a landing slot for C-started fetches"},
    {"fetch_keep", (PyCFunction)Engine_fetch_keep, METH_O,
     "fetch_keep(keep): whether the small files' extents C starts are kept (fuse_fetch.h)"},
    {"fetch_tally", (PyCFunction)Engine_fetch_tally, METH_NOARGS,
     "fetch_tally() -> [(peer, path, len, took_ns, key, block)]: the parts C started and "
     "told in a tally (key, block: None when not kept, else the buffer to adopt)"},
    {"fetch_unpark", (PyCFunction)Engine_fetch_unpark, METH_O,
     "fetch_unpark(cookie) -> int: the READs parked on that fetch answered from the tier now"},
    {"fetch_stop", (PyCFunction)Engine_fetch_stop, METH_VARARGS,
     "fetch_stop(timeout_ms=5000) -> READs abandoned; the soft engines released"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Engine_getset[] = {
    {"eventfd", (getter)Engine_eventfd, NULL, "readable when requests are queued", NULL},
    {"running", (getter)Engine_running, NULL, "whether any request thread runs", NULL},
    {"tier_count", (getter)Engine_tier_count, NULL, "buffers in the memory tier table", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject EngineType = {
    /* the macro ends in a comma that clang-format cannot see */
    /* clang-format off */
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kspeedfs.fuse._engine.Engine",
    /* clang-format on */
    .tp_basicsize = sizeof(EngineObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The native FUSE engine of one mount (request threads on /dev/fuse).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Engine_init,
    .tp_dealloc = (destructor)Engine_dealloc,
    .tp_methods = Engine_methods,
    .tp_getset = Engine_getset,
};

/* ---------------------------------------------------------------- module functions */

/* mount(path, fsname, allow_other, nonempty, max_read) -> the /dev/fuse fd */
static PyObject *mod_mount(PyObject *m, PyObject *args)
{
    PyObject *path;
    const char *fsname;
    int allow_other, nonempty, fd, saved;
    uint32_t max_read;
    char err[256] = "";
    if (!PyArg_ParseTuple(args, "O&sppO&:mount", PyUnicode_FSConverter, &path, &fsname,
                          &allow_other, &nonempty, conv_u32, &max_read))
        return NULL;
    const char *p = PyBytes_AS_STRING(path);
    Py_BEGIN_ALLOW_THREADS
    errno = 0;
    fd = fe_mount(p, fsname, allow_other, nonempty, max_read, err, sizeof err);
    saved = errno ? errno : EIO;
    Py_END_ALLOW_THREADS
    Py_DECREF(path);
    if (fd < 0)
        return raise_errno(saved, "mount: %s", reason(err, saved));
    return PyLong_FromLong(fd);
}

/* unmount(path): lazily (MNT_DETACH); the request threads then end. */
static PyObject *mod_unmount(PyObject *m, PyObject *args)
{
    PyObject *path;
    int rc;
    if (!PyArg_ParseTuple(args, "O&:unmount", PyUnicode_FSConverter, &path))
        return NULL;
    const char *p = PyBytes_AS_STRING(path);
    Py_BEGIN_ALLOW_THREADS
    rc = fe_unmount(p);
    Py_END_ALLOW_THREADS
    PyObject *ret = rc < 0 ? raise_errno(-rc, "unmount: %s: %s", p, strerror(-rc)) : Py_None;
    Py_DECREF(path);
    Py_XINCREF(ret);
    return ret;
}

/* notify_store(fd, nodeid, offset, data) -> 0 or -errno */
static PyObject *mod_notify_store(PyObject *m, PyObject *args)
{
    int fd, rc = -EINVAL;
    uint64_t nodeid, offset;
    Py_buffer b;
    if (!PyArg_ParseTuple(args, "iO&O&y*:notify_store", &fd, conv_u64, &nodeid, conv_u64,
                          &offset, &b))
        return NULL;
    if ((uint64_t)b.len <= UINT32_MAX - 4096) { /* the kernel's size field is u32 */
        Py_BEGIN_ALLOW_THREADS
        rc = fe_notify_store(fd, nodeid, offset, b.buf, (size_t)b.len);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&b);
    return PyLong_FromLong(rc);
}

static void parts_release(Py_buffer *views, Py_ssize_t n)
{
    while (n > 0)
        PyBuffer_Release(&views[--n]);
}

/* One write from the buffers of ``items[0..n)`` (n <= MAX_IOV), GIL released for it. */
static PyObject *reply_parts(int fd, uint64_t unique, PyObject *const *items, Py_ssize_t n)
{
    Py_buffer views[MAX_IOV];
    const void *bufs[MAX_IOV];
    size_t lens[MAX_IOV];
    int rc;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyObject_GetBuffer(items[i], &views[i], PyBUF_SIMPLE) < 0) {
            parts_release(views, i);
            return NULL;
        }
        bufs[i] = views[i].buf;
        lens[i] = (size_t)views[i].len;
    }
    Py_BEGIN_ALLOW_THREADS
    rc = n == 1 ? fe_reply_data(fd, unique, bufs[0], lens[0])
                : fe_reply_iov(fd, unique, bufs, lens, (int)n);
    Py_END_ALLOW_THREADS
    parts_release(views, n);
    return PyLong_FromLong(rc);
}

/* More parts than one writev takes: b"".join them (one copy), then one write. */
static PyObject *reply_joined(int fd, uint64_t unique, PyObject *seq)
{
    PyObject *empty = PyBytes_FromStringAndSize(NULL, 0);
    PyObject *joined = empty ? PyObject_CallMethod(empty, "join", "(O)", seq) : NULL;
    Py_XDECREF(empty);
    if (!joined)
        return NULL;
    PyObject *ret = reply_parts(fd, unique, &joined, 1);
    Py_DECREF(joined);
    return ret;
}

/* reply(fd, unique, data) -> 0 or -errno: data is a buffer or a list/tuple of them.
 * A failed write is returned, never raised (ENOENT: the request was interrupted). */
static PyObject *mod_reply(PyObject *m, PyObject *args)
{
    int fd;
    uint64_t unique;
    PyObject *data;
    if (!PyArg_ParseTuple(args, "iO&O:reply", &fd, conv_u64, &unique, &data))
        return NULL;
    if (!PyList_Check(data) && !PyTuple_Check(data))
        return reply_parts(fd, unique, &data, 1);
    PyObject *fast = PySequence_Fast(data, "reply: data"); /* a new reference */
    if (!fast)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject *ret = n > MAX_IOV ? reply_joined(fd, unique, fast)
                                : reply_parts(fd, unique, PySequence_Fast_ITEMS(fast), n);
    Py_DECREF(fast);
    return ret;
}

/* notify_resend(fd) -> 0 or -errno: the kernel queues again what a dead daemon held */
static PyObject *mod_notify_resend(PyObject *m, PyObject *args)
{
    int fd, rc;
    if (!PyArg_ParseTuple(args, "i:notify_resend", &fd))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = fe_notify_resend(fd);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

/* reply_error(fd, unique, err) -> 0 or -errno */
static PyObject *mod_reply_error(PyObject *m, PyObject *args)
{
    int fd, err, rc;
    uint64_t unique;
    if (!PyArg_ParseTuple(args, "iO&i:reply_error", &fd, conv_u64, &unique, &err))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = fe_reply_error(fd, unique, err);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

/* reply_xattr_size(fd, unique, size) -> 0 or -errno: the answer to a size probe */
static PyObject *mod_reply_xattr_size(PyObject *m, PyObject *args)
{
    int fd, rc;
    uint64_t unique;
    uint32_t size;
    if (!PyArg_ParseTuple(args, "iO&O&:reply_xattr_size", &fd, conv_u64, &unique, conv_u32,
                          &size))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = fe_reply_xattr_size(fd, unique, size);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

/* splice_room() -> the largest reply one pipe of this process carries (0: none). */
static PyObject *mod_splice_room(PyObject *m, PyObject *args)
{
    return PyLong_FromSize_t(fe_splice_room());
}

static PyMethodDef mod_methods[] = {
    {"mount", mod_mount, METH_VARARGS,
     "mount(path, fsname, allow_other, nonempty, max_read) -> /dev/fuse fd (root only)"},
    {"unmount", mod_unmount, METH_VARARGS, "unmount(path): umount2(MNT_DETACH)"},
    {"notify_store", mod_notify_store, METH_VARARGS,
     "notify_store(fd, nodeid, offset, data) -> 0 or -errno (FUSE_NOTIFY_STORE)"},
    {"reply", mod_reply, METH_VARARGS,
     "reply(fd, unique, data or [data, ...]) -> 0 or -errno"},
    {"reply_error", mod_reply_error, METH_VARARGS,
     "reply_error(fd, unique, err) -> 0 or -errno"},
    {"notify_resend", mod_notify_resend, METH_VARARGS,
     "notify_resend(fd) -> 0 or -errno: unanswered requests of the connection are queued again"},
    {"reply_xattr_size", mod_reply_xattr_size, METH_VARARGS,
     "reply_xattr_size(fd, unique, size) -> 0 or -errno"},
    {"splice_room", mod_splice_room, METH_NOARGS,
     "splice_room() -> bytes of the largest reply a pipe of this process carries (0: none)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {
    PyModuleDef_HEAD_INIT,
    "kspeedfs.fuse._engine",
    "The native FUSE data plane (see native/fuse_engine.h).",
    -1,
    mod_methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC PyInit__engine(void)
{
    if (PyType_Ready(&EngineType) < 0 || PyType_Ready(&BlockType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&moddef);
    if (!m)
        return NULL;
    if (PyModule_AddType(m, &EngineType) < 0 || events_ready(m) < 0 ||
        PyModule_AddIntConstant(m, "READ", FE_READ) < 0 ||
        PyModule_AddIntConstant(m, "GETXATTR", FE_GETXATTR) < 0 ||
        PyModule_AddIntConstant(m, "LISTXATTR", FE_LISTXATTR) < 0 ||
        PyModule_AddIntConstant(m, "PREFETCH", FE_PREFETCH) < 0 ||
        PyModule_AddIntConstant(m, "FETCHED", FE_FETCHED) < 0 ||
        PyModule_AddIntConstant(m, "FETCH_OK", FE_FETCH_OK) < 0 ||
        PyModule_AddIntConstant(m, "FETCH_MISMATCH", FE_FETCH_MISMATCH) < 0 ||
        PyModule_AddIntConstant(m, "FETCH_EXISTS", FE_FETCH_EXISTS) < 0 ||
        PyModule_AddIntConstant(m, "FETCH_STOPPED", FE_FETCH_STOPPED) < 0 ||
        PyModule_AddIntConstant(m, "FETCH_NOMEM", FE_FETCH_NOMEM) < 0 ||
        PyModule_AddIntConstant(m, "FETCH_LATE", FE_FETCH_LATE) < 0 ||
        PyModule_AddIntConstant(m, "FETCH_TALLY", FE_FETCH_TALLY) < 0 ||
        PyModule_AddObject(m, "FETCH_OWN", PyLong_FromUnsignedLongLong(FE_OWN)) < 0 ||
        PyModule_AddObject(m, "FETCH_PART", PyLong_FromUnsignedLongLong(FE_PART)) < 0 ||
        PyModule_AddObject(m, "FETCH_BLOCK", PyLong_FromUnsignedLongLong(FE_BLOCK)) < 0 ||
        PyModule_AddIntConstant(m, "FETCH_PEERS", FE_PEERS) < 0 ||
        PyModule_AddIntConstant(m, "FETCH_NICS", FE_NICS) < 0 ||
        PyModule_AddIntConstant(m, "FETCH_STAGING", FE_STAGING) < 0 ||
        PyModule_AddIntConstant(m, "FETCH_SLOTS", FE_SLOTS) < 0 ||
        PyModule_AddIntConstant(m, "FETCH_MAX", FE_FETCH_MAX) < 0 ||
        PyModule_AddIntConstant(m, "BUCKETS", FE_BUCKETS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
