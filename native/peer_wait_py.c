/* peer_wait_py.c — the binding of the library's native fetch (peer_wait.h):
 * kspeedfs.cluster._peerwait.PeerWait, whose ``read`` a reading thread calls without the
 * trio thread; it drops the GIL for the READ, the wait, the xxh3 and the copy. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <poll.h>

#include "peer_wait.h"
#include "fetch_paths_py.h"
#include "py_errno.h"

typedef struct {
    PyObject_HEAD
    struct pw *w;
    const struct ks_capi *api;
    PyObject *held[FE_FETCH_ENGINES]; /* the soft engines with a CQ of ours */
    ks_engine *held_e[FE_FETCH_ENGINES];
    int nheld;
    int readers;     /* callers inside pw_read; GIL */
    uint32_t maxlen; /* the largest staging slot: a longer read is PW_BUSY at once */
} PeerWaitObject;

static int PeerWait_init(PeerWaitObject *self, PyObject *args, PyObject *kw)
{
    PyObject *capsule;
    unsigned long long chunks;
    if (!PyArg_ParseTuple(args, "OK:PeerWait", &capsule, &chunks))
        return -1;
    const struct ks_capi *api = PyCapsule_GetPointer(capsule, KS_CAPI_NAME);
    if (!api)
        return -1;
    if (api->abi != KS_CAPI_ABI || self->w) {
        raise_errno(EINVAL, "PeerWait: wrong C API, or initialised twice");
        return -1;
    }
    char err[256] = "";
    self->w = pw_new(chunks, api, err, sizeof err);
    if (!self->w) {
        raise_errno(ENOMEM, "%s", err);
        return -1;
    }
    self->api = api;
    return 0;
}

static struct pw *live(PeerWaitObject *self)
{
    if (!self->w)
        raise_errno(ESHUTDOWN, "PeerWait: stopped");
    return self->w;
}

/* engine(soft_engine) -> handle: a CQ on that rdma._soft_engine.Engine, held until stop. */
static PyObject *PeerWait_engine(PeerWaitObject *self, PyObject *obj)
{
    struct pw *w = live(self);
    if (!w)
        return NULL;
    for (int i = 0; i < self->nheld; i++)
        if (self->held[i] == obj)
            return PyLong_FromLong(i);
    if (self->nheld == FE_FETCH_ENGINES)
        return raise_errno(ENOSPC, "engine: %d soft engines already", FE_FETCH_ENGINES);
    ks_engine *ke = self->api->hold(obj);
    if (!ke)
        return NULL;
    const char *why = "";
    int rc = pw_engine(w, ke, &why);
    if (rc < 0) {
        self->api->release(obj);
        return raise_errno(-rc, "%s", why);
    }
    self->held[self->nheld] = obj;
    self->held_e[self->nheld] = ke;
    return PyLong_FromLong(self->nheld++);
}

/* staging(laddr, size, lkeys) -> bool: a staging slot (False: PW_STAGING held). */
static PyObject *PeerWait_staging(PeerWaitObject *self, PyObject *args)
{
    unsigned long long laddr;
    unsigned int size;
    PyObject *seq;
    if (!PyArg_ParseTuple(args, "KIO:staging", &laddr, &size, &seq))
        return NULL;
    struct pw *w = live(self);
    PyObject *fast = w ? PySequence_Fast(seq, "staging: lkeys must be a sequence") : NULL;
    if (!fast)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    uint32_t lkeys[FE_NICS];
    for (Py_ssize_t i = 0; i < n && i < FE_NICS; i++)
        lkeys[i] = (uint32_t)PyLong_AsUnsignedLong(PySequence_Fast_GET_ITEM(fast, i));
    Py_DECREF(fast);
    if (PyErr_Occurred())
        return NULL;
    if (n < 1 || n > FE_NICS)
        return raise_errno(EINVAL, "staging: 1 to %d lkeys", FE_NICS);
    int rc = pw_staging(w, (void *)(uintptr_t)laddr, size, lkeys, (int)n);
    if (rc == 0 && size > self->maxlen)
        self->maxlen = size;
    return PyBool_FromLong(rc == 0);
}

/* peer(peer, paths): its UP paths, each (handle, qpn, raddr, rkey, nic); [] turns it off. */
static PyObject *PeerWait_peer(PeerWaitObject *self, PyObject *args)
{
    int peer;
    PyObject *seq;
    if (!PyArg_ParseTuple(args, "iO:peer", &peer, &seq))
        return NULL;
    struct pw *w = live(self);
    struct fe_path paths[FE_PATHS];
    Py_ssize_t n = w ? fetch_paths_parse(seq, self->held_e, self->nheld, paths, "peer") : -1;
    if (n < 0)
        return NULL;
    int rc = pw_peer(w, peer, paths, (int)n);
    if (rc < 0)
        return raise_errno(-rc, "peer: peer or NIC out of range");
    Py_RETURN_NONE;
}

/* route(chunk, peer, offset): chunk ``chunk`` at ``offset`` of that peer's arena (-1: none). */
static PyObject *PeerWait_route(PeerWaitObject *self, PyObject *args)
{
    unsigned long long k, offset;
    int peer;
    if (!PyArg_ParseTuple(args, "KiK:route", &k, &peer, &offset))
        return NULL;
    struct pw *w = live(self);
    if (!w)
        return NULL;
    if (pw_route(w, k, peer, offset) < 0)
        return raise_errno(EINVAL, "route: chunk, peer or offset out of range");
    Py_RETURN_NONE;
}

static PyObject *PeerWait_unroute(PeerWaitObject *self, PyObject *unused)
{
    struct pw *w = live(self);
    if (!w)
        return NULL;
    pw_unroute(w);
    Py_RETURN_NONE;
}

/* read(chunk, offset, length, want, timeout_ns) -> bytes | int: the verified bytes, or
 * the status (go to the Python read path). */
static PyObject *PeerWait_read(PeerWaitObject *self, PyObject *args)
{
    unsigned long long k, offset, timeout_ns;
    unsigned int len;
    Py_buffer want;
    if (!PyArg_ParseTuple(args, "KKIy*K:read", &k, &offset, &len, &want, &timeout_ns))
        return NULL;
    struct pw *w = self->w;
    if (want.len != 16 || !len || !w) {
        PyBuffer_Release(&want);
        if (w && (want.len != 16 || !len))
            return raise_errno(EINVAL, "read: a 16-byte digest and a length");
        return PyLong_FromLong(PW_NO_ROUTE);
    }
    uint8_t digest[16];
    memcpy(digest, want.buf, 16);
    PyBuffer_Release(&want);
    if (len > self->maxlen) /* no slot holds it: not worth a buffer */
        return PyLong_FromLong(PW_BUSY);
    /* a bytes object nobody else sees yet: filled without the GIL (rdma/buffer.py
     * copy_out says why its page faults should not hold it) */
    PyObject *out = PyBytes_FromStringAndSize(NULL, len);
    if (!out)
        return NULL;
    int st;
    self->readers++;
    Py_BEGIN_ALLOW_THREADS
    st = pw_read(w, k, offset, len, digest, PyBytes_AS_STRING(out), timeout_ns);
    Py_END_ALLOW_THREADS
    self->readers--;
    if (st == FE_FETCH_OK)
        return out;
    Py_DECREF(out);
    return PyLong_FromLong(st);
}

/* tallies() -> [(peer, path, qpn, ok, bytes, failed, late)]: since the last call. */
static PyObject *PeerWait_tallies(PeerWaitObject *self, PyObject *unused)
{
    struct pw *w = live(self);
    if (!w)
        return NULL;
    struct pw_tally t[FE_PEERS * FE_PATHS];
    int n = pw_tallies(w, t, FE_PEERS * FE_PATHS);
    PyObject *list = PyList_New(n);
    for (int i = 0; list && i < n; i++) {
        PyObject *x = Py_BuildValue("(iiIKKKK)", t[i].peer, t[i].path, t[i].qpn,
                                    (unsigned long long)t[i].ok,
                                    (unsigned long long)t[i].bytes,
                                    (unsigned long long)t[i].failed,
                                    (unsigned long long)t[i].late);
        if (!x) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, i, x);
    }
    return list;
}

/* samples() -> [(peer, path, length, ns)]: ok READs since the last call (pw_samples). */
static PyObject *PeerWait_samples(PeerWaitObject *self, PyObject *unused)
{
    struct pw *w = live(self);
    if (!w)
        return NULL;
    struct fe_sample *s = PyMem_Malloc(sizeof *s * PW_SAMPLES);
    if (!s)
        return PyErr_NoMemory();
    int n = pw_samples(w, s, PW_SAMPLES);
    PyObject *list = PyList_New(n);
    for (int i = 0; list && i < n; i++) {
        PyObject *x = Py_BuildValue("(iiIK)", s[i].peer, s[i].path, s[i].len,
                                    (unsigned long long)s[i].took_ns);
        if (!x) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, i, x);
    }
    PyMem_Free(s);
    return list;
}

/* The READs out, the reaper and the CQs gone; the soft engines released. */
static int stop(PeerWaitObject *self, int timeout_ms)
{
    if (!self->w)
        return 0;
    int left;
    struct pw *w = self->w;
    Py_BEGIN_ALLOW_THREADS
    left = pw_stop(w, timeout_ms);
    Py_END_ALLOW_THREADS
    while (self->readers) { /* a caller still inside: it returns within its timeout */
        Py_BEGIN_ALLOW_THREADS
        poll(NULL, 0, 5);
        Py_END_ALLOW_THREADS
    }
    pw_free(w);
    self->w = NULL;
    while (self->nheld)
        self->api->release(self->held[--self->nheld]);
    return left;
}

/* stop(timeout_ms) -> READs still out (their CQs left to the soft engine's close). */
static PyObject *PeerWait_stop(PeerWaitObject *self, PyObject *arg)
{
    int ms = PyLong_AsLong(arg);
    if (ms == -1 && PyErr_Occurred())
        return NULL;
    return PyLong_FromLong(stop(self, ms));
}

static void PeerWait_dealloc(PeerWaitObject *self)
{
    stop(self, 0);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef PeerWait_methods[] = {
    {"engine", (PyCFunction)PeerWait_engine, METH_O, "engine(soft_engine) -> handle"},
    {"staging", (PyCFunction)PeerWait_staging, METH_VARARGS, "staging(laddr, size, lkeys)"},
    {"peer", (PyCFunction)PeerWait_peer, METH_VARARGS, "peer(peer, paths)"},
    {"route", (PyCFunction)PeerWait_route, METH_VARARGS, "route(chunk, peer, offset)"},
    {"unroute", (PyCFunction)PeerWait_unroute, METH_NOARGS, "unroute()"},
    {"read", (PyCFunction)PeerWait_read, METH_VARARGS,
     "read(chunk, offset, length, want, timeout_ns) -> bytes | status"},
    {"tallies", (PyCFunction)PeerWait_tallies, METH_NOARGS, "tallies() -> list"},
    {"samples", (PyCFunction)PeerWait_samples, METH_NOARGS, "samples() -> list"},
    {"stop", (PyCFunction)PeerWait_stop, METH_O, "stop(timeout_ms) -> READs left"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject PeerWaitType = {
    /* clang-format off */
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kspeedfs.cluster._peerwait.PeerWait",
    /* clang-format on */
    .tp_basicsize = sizeof(PeerWaitObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A small file's extent READ from a peer by the calling thread (peer_wait.h).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)PeerWait_init,
    .tp_dealloc = (destructor)PeerWait_dealloc,
    .tp_methods = PeerWait_methods,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT,
                                    "kspeedfs.cluster._peerwait",
                                    NULL,
                                    -1,
                                    NULL,
                                    NULL,
                                    NULL,
                                    NULL,
                                    NULL};

PyMODINIT_FUNC PyInit__peerwait(void)
{
    if (PyType_Ready(&PeerWaitType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    Py_INCREF(&PeerWaitType);
    if (PyModule_AddObject(m, "PeerWait", (PyObject *)&PeerWaitType) < 0) {
        Py_DECREF(&PeerWaitType);
        Py_DECREF(m);
        return NULL;
    }
    static const struct {
        const char *name;
        int value;
    } consts[] = {
        {"OK", FE_FETCH_OK},     {"SHORT", FE_FETCH_SHORT}, {"MISMATCH", FE_FETCH_MISMATCH},
        {"LATE", FE_FETCH_LATE}, {"NO_ROUTE", PW_NO_ROUTE}, {"BUSY", PW_BUSY},
        {"POST", PW_POST},       {"STAGING", PW_STAGING},   {"PEERS", FE_PEERS},
        {"NICS", FE_NICS},       {"SAMPLES", PW_SAMPLES}};
    for (size_t i = 0; i < sizeof consts / sizeof *consts; i++)
        if (PyModule_AddIntConstant(m, consts[i].name, consts[i].value) < 0) {
            Py_DECREF(m);
            return NULL;
        }
    return m;
}
