/* fuse_fetch_py.c — the binding of the native chunk fetch (fuse_fetch.h): the Engine's
 * fetch_* methods and read_or_park, and Block, the read-only buffer of an extent the
 * fetch landed. */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include "fuse_engine_py.h"

#include <errno.h>
#include <stdlib.h>

#include "fetch_paths_py.h"
#include "py_errno.h"

/* fetch_enable(capsule): start the native fetch on the soft engine's C API
 * (rdma._soft_engine._C_API). */
PyObject *Engine_fetch_enable(EngineObject *self, PyObject *capsule)
{
    struct fe_engine *e = engine_of(self, "fetch_enable");
    if (!e)
        return NULL;
    const struct ks_capi *api = PyCapsule_GetPointer(capsule, KS_CAPI_NAME);
    if (!api)
        return NULL;
    char err[256] = "";
    int rc = fe_fetch_enable(e, api, err, sizeof err);
    if (rc < 0)
        return raise_errno(-rc, "fetch_enable: %s", reason(err, -rc));
    self->capi = api;
    Py_RETURN_NONE;
}

/* The engine's native fetch, or NULL with an exception set (none enabled: EINVAL). */
static struct fe_fetch *fetch_of(EngineObject *self, const char *what)
{
    struct fe_engine *e = engine_of(self, what);
    struct fe_fetch *f = e ? fe_fetcher(e) : NULL;
    if (e && !f)
        raise_errno(EINVAL, "%s: fetch_enable first", what);
    return f;
}

/* fetch_engine(soft_engine) -> handle: a fetch CQ on that rdma._soft_engine.Engine,
 * which stays held (its close() refuses) until fetch_stop. */
PyObject *Engine_fetch_engine(EngineObject *self, PyObject *obj)
{
    struct fe_fetch *f = fetch_of(self, "fetch_engine");
    if (!f)
        return NULL;
    for (int i = 0; i < self->nheld; i++)
        if (self->held[i] == obj)
            return PyLong_FromLong(i);
    if (self->nheld == FE_FETCH_ENGINES)
        return raise_errno(ENOSPC, "fetch_engine: %d soft engines already", FE_FETCH_ENGINES);
    ks_engine *ke = self->capi->hold(obj);
    if (!ke)
        return NULL;
    const char *why = "";
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = fetch_engine(f, ke, &why);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        self->capi->release(obj);
        return raise_errno(-rc, "%s", why);
    }
    self->held[self->nheld] = obj;
    self->held_e[self->nheld] = ke;
    return PyLong_FromLong(self->nheld++);
}

/* fetch_post(handle, qpn, chunk, cookie, laddr, lkey, raddr, rkey, length): one READ of
 * chunk ``chunk`` into the landing slot at ``laddr``; OSError EALREADY (in flight),
 * EAGAIN (too many), ESHUTDOWN (stopped), or the post's error. */
/* The engine's fetch and the soft engine ``handle`` names (fetch_engine's), for the posts;
 * NULL with OSError(EINVAL) raised when either is missing. */
static struct fe_fetch *fetch_on(EngineObject *self, struct fe_engine *e, int handle,
                                 const char *what, ks_engine **ke)
{
    struct fe_fetch *f = fe_fetcher(e);
    if (!f || handle < 0 || handle >= self->nheld) {
        raise_errno(EINVAL, "%s: no such fetch engine", what);
        return NULL;
    }
    *ke = self->held_e[handle];
    return f;
}

PyObject *Engine_fetch_post(EngineObject *self, PyObject *args)
{
    int handle;
    unsigned int qpn, lkey, rkey, len;
    unsigned long long k, cookie, laddr, raddr;
    if (!PyArg_ParseTuple(args, "iIKKKIKII:fetch_post", &handle, &qpn, &k, &cookie, &laddr,
                          &lkey, &raddr, &rkey, &len))
        return NULL;
    struct fe_engine *e = engine_of(self, "fetch_post");
    ks_engine *ke;
    struct fe_fetch *f = e ? fetch_on(self, e, handle, "fetch_post", &ke) : NULL;
    if (!f)
        return NULL;
    const char *why = "";
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = fetch_post(f, ke, qpn, k, cookie, (void *)(uintptr_t)laddr, lkey, raddr, rkey, len,
                    &why);
    Py_END_ALLOW_THREADS
    if (rc < 0)
        return raise_errno(-rc, "%s", why);
    Py_RETURN_NONE;
}

/* A buffer the native fetch filled (an extent, fetch_landed): read-only, freed with the
 * object. The tier entry that points into it is adopted by putting a view of it. */
typedef struct {
    PyObject_HEAD
    void *buf;
    Py_ssize_t len;
} BlockObject;

static int Block_getbuffer(BlockObject *self, Py_buffer *view, int flags)
{
    return PyBuffer_FillInfo(view, (PyObject *)self, self->buf, self->len, 1, flags);
}

static void Block_dealloc(BlockObject *self)
{
    free(self->buf);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyBufferProcs Block_as_buffer = {(getbufferproc)Block_getbuffer, NULL};

PyTypeObject BlockType = {
    /* the macro ends in a comma that clang-format cannot see */
    /* clang-format off */
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kspeedfs.fuse._engine.Block",
    /* clang-format on */
    .tp_basicsize = sizeof(BlockObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Verified bytes the native fetch copied out of a staging slot (read-only).",
    .tp_dealloc = (destructor)Block_dealloc,
    .tp_as_buffer = &Block_as_buffer,
};

/* A READ of ``entry`` taken from the queue, as Python holds it: (fd, unique, offset, size,
 * random, since). 0, or -1 with an exception set. */
static int read_request(PyObject *read, unsigned long long entry, struct fe_read *q)
{
    double since = 0;
    *q = (struct fe_read){.entry = entry};
    if (!PyArg_ParseTuple(read, "iKKKid:READ", &q->fd, &q->unique, &q->offset, &q->size,
                          &q->random, &since))
        return -1;
    q->t0 = since > 0 ? (uint64_t)(since * 1e9) : 0;
    return 0;
}

/* read_or_park(entry, read) -> bool: ``read``, a READ of ``entry`` taken from the queue,
 * answered from the tier or parked in C on one of its chunks the native fetch has in
 * flight (answered when it lands, or queued again if it fails): True; False: it stays
 * the caller's. */
PyObject *Engine_read_or_park(EngineObject *self, PyObject *args)
{
    unsigned long long entry;
    PyObject *read;
    if (!PyArg_ParseTuple(args, "KO!:read_or_park", &entry, &PyTuple_Type, &read))
        return NULL;
    struct fe_engine *e = engine_of(self, "read_or_park");
    struct fe_read q;
    if (!e || read_request(read, entry, &q) < 0)
        return NULL;
    int taken;
    Py_BEGIN_ALLOW_THREADS
    taken = fe_read_or_park(e, &q);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(taken);
}

/* fetch_post_extent and fetch_post_block: ``read`` (None, or a READ of ``entry`` taken from
 * the queue: (fd, unique, offset, size, random, since)) parked on one READ of ``len``
 * bytes into the staging buffer at laddr/lkey, verified against ``want``, copied into a
 * buffer of its own and put in the tier under ``key`` (fuse_fetch.h fetch_post_part).
 * Raised: ``read`` stays the caller's. */
static PyObject *post_part(EngineObject *self, struct fe_engine *e, int handle,
                           unsigned int qpn, const uint8_t *key, size_t keylen,
                           const uint8_t *want, size_t wantlen, uint32_t len,
                           unsigned long long entry, unsigned long long cookie,
                           unsigned long long laddr, unsigned int lkey,
                           unsigned long long raddr, unsigned int rkey, PyObject *read)
{
    struct fe_read q;
    if (read != Py_None && read_request(read, entry, &q) < 0)
        return NULL;
    ks_engine *ke;
    struct fe_fetch *f = fetch_on(self, e, handle, "fetch_post_part", &ke);
    if (!f)
        return NULL;
    const char *why = "";
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = fetch_post_part(f, ke, qpn, key, keylen, want, wantlen, read != Py_None ? &q : NULL,
                         cookie, (void *)(uintptr_t)laddr, lkey, raddr, rkey, len, &why);
    Py_END_ALLOW_THREADS
    if (rc < 0)
        return raise_errno(-rc, "%s", why);
    Py_RETURN_NONE;
}

/* fetch_post_extent(handle, qpn, entry, cookie, laddr, lkey, raddr, rkey, read=None): one
 * READ of small file ``entry``'s extent, its digest (the tier key too) and length from the
 * engine's index; taken back with ``fetch_landed(cookie)`` once FETCHED says 0. */
PyObject *Engine_fetch_post_extent(EngineObject *self, PyObject *args)
{
    int handle;
    unsigned int qpn, lkey, rkey;
    unsigned long long entry, cookie, laddr, raddr;
    PyObject *read = Py_None;
    if (!PyArg_ParseTuple(args, "iIKKKIKI|O:fetch_post_extent", &handle, &qpn, &entry, &cookie,
                          &laddr, &lkey, &raddr, &rkey, &read))
        return NULL;
    struct fe_engine *e = engine_of(self, "fetch_post_extent");
    if (!e)
        return NULL;
    const uint8_t *key;
    uint32_t len;
    if (fe_file_extent(e, entry, &key, &len) < 0)
        return raise_errno(EINVAL, "fetch_post_extent: not a file in one chunk");
    return post_part(self, e, handle, qpn, key, 16, key, 16, len, entry, cookie, laddr, lkey,
                     raddr, rkey, read);
}

/* fetch_post_block(handle, qpn, entry, chunk, block, digest, cookie, laddr, lkey, raddr,
 * rkey, read=None): the same for block ``block`` of ``chunk`` (its tier key and length
 * from the engine's index), verified against ``digest`` (its xxh3-64, 8 bytes, from the
 * manifest); ``read`` is a READ of ``entry``. */
PyObject *Engine_fetch_post_block(EngineObject *self, PyObject *args)
{
    int handle;
    unsigned int qpn, lkey, rkey;
    unsigned long long entry, chunk, block, cookie, laddr, raddr;
    const char *digest;
    Py_ssize_t dlen;
    PyObject *read = Py_None;
    if (!PyArg_ParseTuple(args, "iIKKKy#KKIKI|O:fetch_post_block", &handle, &qpn, &entry,
                          &chunk, &block, &digest, &dlen, &cookie, &laddr, &lkey, &raddr,
                          &rkey, &read))
        return NULL;
    struct fe_engine *e = engine_of(self, "fetch_post_block");
    if (!e)
        return NULL;
    uint8_t key[20];
    uint32_t len;
    if (dlen != 8 || fe_chunk_block(e, chunk, block, key, &len) < 0)
        return raise_errno(EINVAL, "fetch_post_block: no such block, or not an 8-byte digest");
    return post_part(self, e, handle, qpn, key, 20, (const uint8_t *)digest, 8, len, entry,
                     cookie, laddr, lkey, raddr, rkey, read);
}

/* The fetch of ``self`` and the cookie ``arg`` names (fetch_landed, fetch_unpark): 1 with
 * both, 0 when the engine has no fetch (nothing to do), -1 with an exception set. */
static int fetch_and_cookie(EngineObject *self, PyObject *arg, const char *what,
                            struct fe_fetch **f, unsigned long long *cookie)
{
    *cookie = PyLong_AsUnsignedLongLong(arg);
    if (*cookie == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    struct fe_engine *e = engine_of(self, what);
    if (!e)
        return -1;
    *f = fe_fetcher(e);
    return *f != NULL;
}

/* fetch_landed(cookie) -> Block | None: the buffer an extent's fetch put in the tier. */
PyObject *Engine_fetch_landed(EngineObject *self, PyObject *arg)
{
    struct fe_fetch *f;
    unsigned long long cookie;
    int have = fetch_and_cookie(self, arg, "fetch_landed", &f, &cookie);
    if (have <= 0)
        return have < 0 ? NULL : Py_NewRef(Py_None);
    BlockObject *b = PyObject_New(BlockObject, &BlockType); /* first: once taken, the */
    if (!b)                                                 /* buffer must have an owner */
        return NULL;
    uint32_t len = 0;
    b->buf = fetch_landed(f, cookie, &len);
    b->len = len;
    if (!b->buf) {
        Py_DECREF(b);
        Py_RETURN_NONE;
    }
    return (PyObject *)b;
}

/* fetch_peer(peer, paths, limit_ns): peer ``peer``'s UP paths, each (handle, qpn, raddr,
 * rkey, nic): the fetch engine, QP, the arena's first byte and rkey through it, and which
 * lkey of a landing slot it takes; [] turns the peer off. */
PyObject *Engine_fetch_peer(EngineObject *self, PyObject *args)
{
    int peer;
    PyObject *seq;
    unsigned long long limit_ns;
    PyObject *parts = NULL;
    if (!PyArg_ParseTuple(args, "iOK|O:fetch_peer", &peer, &seq, &limit_ns, &parts))
        return NULL;
    struct fe_fetch *f = fetch_of(self, "fetch_peer");
    if (!f)
        return NULL;
    struct fe_path paths[FE_PATHS];
    Py_ssize_t n = fetch_paths_parse(seq, self->held_e, self->nheld, paths, "fetch_peer");
    if (n < 0)
        return NULL;
    uint64_t part_limits[FE_SIZE_CLASSES] = {0};
    if (parts) {
        PyObject *pf = PySequence_Fast(parts, "fetch_peer: part limits must be a sequence");
        if (!pf)
            return NULL;
        Py_ssize_t np = PySequence_Fast_GET_SIZE(pf);
        for (Py_ssize_t i = 0; i < np && i < FE_SIZE_CLASSES; i++) {
            part_limits[i] = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(pf, i));
            if (PyErr_Occurred()) {
                Py_DECREF(pf);
                return NULL;
            }
        }
        Py_DECREF(pf);
        if (np > FE_SIZE_CLASSES)
            return raise_errno(EINVAL, "fetch_peer: more than %d part limits",
                               FE_SIZE_CLASSES);
    }
    int rc = fetch_peer(f, peer, paths, (int)n, limit_ns, part_limits);
    if (rc < 0)
        return raise_errno(-rc, "fetch_peer: no such peer, NIC or fetch CQ");
    Py_RETURN_NONE;
}

/* fetch_route(chunk, peer, offset): the chunk lies at ``offset`` of that peer's arena
 * (peer -1: no route). */
PyObject *Engine_fetch_route(EngineObject *self, PyObject *args)
{
    unsigned long long k, offset;
    int peer;
    if (!PyArg_ParseTuple(args, "KiK:fetch_route", &k, &peer, &offset))
        return NULL;
    struct fe_fetch *f = fetch_of(self, "fetch_route");
    if (!f)
        return NULL;
    if (fetch_route(f, k, peer, offset) < 0)
        return raise_errno(EINVAL, "fetch_route: no such chunk or peer, or offset too large");
    Py_RETURN_NONE;
}

/* fetch_unroute(): every route and peer forgotten. */
PyObject *Engine_fetch_unroute(EngineObject *self, PyObject *unused)
{
    struct fe_engine *e = engine_of(self, "fetch_unroute");
    struct fe_fetch *f = e ? fe_fetcher(e) : NULL;
    if (f)
        fetch_unroute(f);
    if (!e)
        return NULL;
    Py_RETURN_NONE;
}

/* ``seq``, a sequence of lkeys (one per local NIC, at most FE_NICS), into ``lkeys``; their
 * number, or -1 with an exception set. */
static int lkeys_of(PyObject *seq, uint32_t lkeys[FE_NICS], const char *what)
{
    PyObject *fast = PySequence_Fast(seq, "lkeys must be a sequence");
    if (!fast)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (n > FE_NICS) {
        Py_DECREF(fast);
        raise_errno(EINVAL, "%s: more than %d lkeys", what, FE_NICS);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long v = PyLong_AsUnsignedLong(PySequence_Fast_GET_ITEM(fast, i));
        if (v == (unsigned long)-1 && PyErr_Occurred()) {
            Py_DECREF(fast);
            return -1;
        }
        lkeys[i] = (uint32_t)v;
    }
    Py_DECREF(fast);
    return (int)n;
}

/* fetch_slot(id, laddr, lkeys) -> bool: a landing slot for C-started fetches (False: C
 * holds FE_SLOTS already). */
PyObject *Engine_fetch_slot(EngineObject *self, PyObject *args)
{
    unsigned int id;
    unsigned long long laddr;
    PyObject *seq;
    if (!PyArg_ParseTuple(args, "IKO:fetch_slot", &id, &laddr, &seq))
        return NULL;
    struct fe_fetch *f = fetch_of(self, "fetch_slot");
    uint32_t lkeys[FE_NICS];
    int n = f ? lkeys_of(seq, lkeys, "fetch_slot") : -1;
    if (n < 0)
        return NULL;
    int rc = fetch_slot(f, id, (void *)(uintptr_t)laddr, lkeys, n);
    if (rc == -EINVAL)
        return raise_errno(EINVAL, "fetch_slot: bad lkeys");
    return PyBool_FromLong(rc == 0);
}

/* fetch_staging(laddr, size, lkeys) -> bool: a staging slot of ``size`` bytes for the small
 * files' extents C starts, C's for good (False: C holds FE_STAGING already). */
PyObject *Engine_fetch_staging(EngineObject *self, PyObject *args)
{
    unsigned long long laddr;
    unsigned int size;
    PyObject *seq;
    if (!PyArg_ParseTuple(args, "KIO:fetch_staging", &laddr, &size, &seq))
        return NULL;
    struct fe_fetch *f = fetch_of(self, "fetch_staging");
    uint32_t lkeys[FE_NICS];
    int n = f ? lkeys_of(seq, lkeys, "fetch_staging") : -1;
    if (n < 0)
        return NULL;
    int rc = fetch_staging(f, (void *)(uintptr_t)laddr, size, lkeys, n);
    if (rc == -EINVAL)
        return raise_errno(EINVAL, "fetch_staging: bad lkeys or size 0");
    return PyBool_FromLong(rc == 0);
}

/* fetch_unpark(cookie) -> int: answer the READs parked on that fetch from the tier now. */
PyObject *Engine_fetch_unpark(EngineObject *self, PyObject *arg)
{
    struct fe_fetch *f;
    unsigned long long cookie;
    int have = fetch_and_cookie(self, arg, "fetch_unpark", &f, &cookie);
    if (have <= 0)
        return have < 0 ? NULL : PyLong_FromLong(0);
    int n;
    Py_BEGIN_ALLOW_THREADS
    n = fetch_unpark(f, cookie);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(n);
}

/* fetch_keep(keep): whether the extents C starts are kept (fuse_fetch.h fetch_keep). */
PyObject *Engine_fetch_keep(EngineObject *self, PyObject *arg)
{
    int keep = PyObject_IsTrue(arg);
    if (keep < 0)
        return NULL;
    struct fe_engine *e = engine_of(self, "fetch_keep");
    if (!e)
        return NULL;
    struct fe_fetch *f = fe_fetcher(e);
    if (f)
        fetch_keep(f, keep);
    Py_RETURN_NONE;
}

/* One sample as Python takes it: (peer, path, len, took_ns, key, block); key and block
 * None for a part not kept, else its tier key and its buffer (a Block, which owns it from
 * here on). The Block is made last, so nothing fails after it: on a failure before, the
 * buffer stays the tier's, unowned (leaked, never freed under a reader). */
static PyObject *sample_tuple(const struct fe_sample *x)
{
    PyObject *t = PyTuple_New(6);
    if (!t)
        return NULL;
    PyTuple_SET_ITEM(t, 0, PyLong_FromLong(x->peer));
    PyTuple_SET_ITEM(t, 1, PyLong_FromLong(x->path));
    PyTuple_SET_ITEM(t, 2, PyLong_FromUnsignedLong(x->len));
    PyTuple_SET_ITEM(t, 3, PyLong_FromUnsignedLongLong(x->took_ns));
    PyTuple_SET_ITEM(t, 4,
                     x->buf ? PyBytes_FromStringAndSize((const char *)x->key, x->keylen)
                            : Py_NewRef(Py_None));
    BlockObject *b = NULL;
    for (int i = 0; i < 5; i++)
        if (!PyTuple_GET_ITEM(t, i))
            goto fail;
    if (x->buf && !(b = PyObject_New(BlockObject, &BlockType)))
        goto fail;
    if (b) {
        b->buf = x->buf;
        b->len = x->len;
    }
    PyTuple_SET_ITEM(t, 5, b ? (PyObject *)b : Py_NewRef(Py_None));
    return t;
fail:
    Py_DECREF(t);
    return NULL;
}

/* fetch_tally() -> [(peer, path, len, took_ns, key, block)]: the samples of the parts C
 * started and told in the tally, oldest first (fuse_fetch.h fetch_tally); key and block
 * None for an extent answered from its staging slot and not kept, else the tier key and
 * the buffer the tier holds under it with no owner, for the caller to adopt (tier_put). */
PyObject *Engine_fetch_tally(EngineObject *self, PyObject *unused)
{
    struct fe_engine *e = engine_of(self, "fetch_tally");
    if (!e)
        return NULL;
    struct fe_fetch *f = fe_fetcher(e);
    if (!f)
        return PyList_New(0);
    static struct fe_sample got[FE_TALLY_MAX]; /* (the GIL is held) */
    int n = fetch_tally(f, got, FE_TALLY_MAX);
    PyObject *out = PyList_New(n);
    for (int i = 0; i < n; i++) {
        PyObject *t = out ? sample_tuple(&got[i]) : NULL;
        if (t) {
            PyList_SET_ITEM(out, i, t);
            continue;
        }
        for (int j = 0; out && j < i; j++) { /* every buffer taken stays the tier's */
            PyObject *b = PyTuple_GET_ITEM(PyList_GET_ITEM(out, j), 5);
            if (b != Py_None)
                ((BlockObject *)b)->buf = NULL;
        }
        Py_XDECREF(out);
        out = NULL;
    }
    return out;
}

/* Stop the fetch (waiting up to ``timeout_ms`` for READs out) and release the soft
 * engines it held. Returns the READs abandoned. */
int fetch_release(EngineObject *self, struct fe_engine *e, int timeout_ms)
{
    struct fe_fetch *f = fe_fetcher(e);
    int left = 0;
    if (!f)
        return 0;
    Py_BEGIN_ALLOW_THREADS
    left = fetch_stop(f, timeout_ms);
    Py_END_ALLOW_THREADS
    while (self->nheld > 0) {
        self->nheld--;
        self->capi->release(self->held[self->nheld]);
        self->held[self->nheld] = NULL;
    }
    return left;
}

/* fetch_stop(timeout_ms=5000) -> int: no more fetches; the READs still out after the
 * timeout (their landing slots must never be reused: a NIC may yet write them). */
PyObject *Engine_fetch_stop(EngineObject *self, PyObject *args)
{
    int timeout_ms = 5000;
    if (!PyArg_ParseTuple(args, "|i:fetch_stop", &timeout_ms))
        return NULL;
    struct fe_engine *e = engine_of(self, "fetch_stop");
    return e ? PyLong_FromLong(fetch_release(self, e, timeout_ms)) : NULL;
}
