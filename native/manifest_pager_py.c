/* manifest_pager_py.c — the CPython binding of the page map (manifest_pager.h): module
 * kspeedfs.manifest._pager, type PageMap. kspeedfs/manifest/pager.py wraps it.
 *
 * A PageMap exports the region as a read-only buffer (memoryview(pm): format 'B', the
 * blob's length), counted as Python's mmap object counts its exports: close() raises
 * BufferError while any is alive, or while a C API user holds the map, since unmapping
 * under a reader would make its next access a SIGSEGV.
 *
 * A forked child inherits the object but not the mapping (MADV_DONTFORK) nor the handler
 * threads: there every method but close raises RuntimeError, and close (or the object's
 * end) only frees the child's copy. The GIL is released around close, which joins the
 * handler threads (one may be finishing a fill).
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <unistd.h>

#include "manifest_pager.h"
#include "py_errno.h"

typedef struct {
    PyObject_HEAD
    struct mp *m;       /* NULL until opened, and once closed; the GIL guards it */
    Py_ssize_t exports; /* buffers over the region alive; GIL */
    int holds;          /* C API users (capi_hold); GIL */
    pid_t pid;          /* the process that opened it */
} PageMapObject;

/* The open map, or NULL with ValueError (closed) or RuntimeError (a forked child). */
static struct mp *map_of(PageMapObject *self)
{
    if (!self->m) {
        PyErr_SetString(PyExc_ValueError, "PageMap is closed");
        return NULL;
    }
    if (self->pid != getpid()) {
        PyErr_SetString(PyExc_RuntimeError,
                        "PageMap used in a forked child: the mapping stays with the parent");
        return NULL;
    }
    return self->m;
}

/* Give the map up: closed in the process that opened it, abandoned in a forked child. */
static void drop(PageMapObject *self)
{
    struct mp *m = self->m;
    self->m = NULL;
    if (!m)
        return;
    if (self->pid != getpid()) {
        mp_abandon(m);
        return;
    }
    Py_BEGIN_ALLOW_THREADS
    mp_close(m);
    Py_END_ALLOW_THREADS
}

/* ``dirs``: a sequence of str or bytes paths, into ``paths`` (n new references of bytes
 * objects) and ``names`` (their char *). -1 with an exception set. */
static int parse_dirs(PyObject *dirs, PyObject ***paths, const char ***names, size_t *n)
{
    PyObject *seq = PySequence_Fast(dirs, "dirs: a sequence of paths");
    if (!seq)
        return -1;
    Py_ssize_t k = PySequence_Fast_GET_SIZE(seq);
    *n = 0;
    *paths = PyMem_Calloc(k ? (size_t)k : 1, sizeof **paths);
    *names = PyMem_Calloc(k ? (size_t)k : 1, sizeof **names);
    if (!*paths || !*names) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < k; i++) {
        if (!PyUnicode_FSConverter(PySequence_Fast_GET_ITEM(seq, i), &(*paths)[i])) {
            Py_DECREF(seq);
            return -1;
        }
        (*n)++;
        (*names)[i] = PyBytes_AS_STRING((*paths)[i]);
    }
    Py_DECREF(seq);
    return 0;
}

static void free_dirs(PyObject **paths, const char **names, size_t n)
{
    for (size_t i = 0; paths && i < n; i++)
        Py_XDECREF(paths[i]);
    PyMem_Free(paths);
    PyMem_Free(names);
}

static int PageMap_init(PageMapObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"size",    "page_size", "hashes", "dirs", "cache_bytes",
                             "threads", "ask",       "ask_ms", NULL};
    unsigned long long size, page_size, cache_bytes;
    Py_buffer hashes;
    PyObject *dirs;
    int threads = 2, ask_ms = 10000;
    const char *ask = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "KKy*OK|izi:PageMap", kwlist, &size, &page_size,
                                     &hashes, &dirs, &cache_bytes, &threads, &ask, &ask_ms))
        return -1;
    PyObject **paths = NULL;
    const char **names = NULL;
    size_t ndirs = 0;
    int rc = -1;
    if (self->m) {
        PyErr_SetString(PyExc_RuntimeError, "PageMap already open");
        goto out;
    }
    if (parse_dirs(dirs, &paths, &names, &ndirs) < 0)
        goto out;
    size_t pages = mp_pages((size_t)size, (size_t)page_size);
    if (page_size && (size_t)hashes.len != pages * MP_HASH_LEN) {
        PyErr_Format(PyExc_ValueError, "hashes: %zd bytes, not %d per page (%zu pages)",
                     hashes.len, MP_HASH_LEN, pages);
        goto out;
    }
    struct mp_config cfg = {.size = (size_t)size,
                            .page_size = (size_t)page_size,
                            .hashes = hashes.buf,
                            .dirs = names,
                            .ndirs = ndirs,
                            .cache_bytes = (size_t)cache_bytes,
                            .threads = threads,
                            .ask = ask,
                            .ask_ms = ask_ms};
    char why[256] = "";
    struct mp *m = NULL;
    int err = mp_open(&cfg, &m, why, sizeof why);
    if (err == -EINVAL) {
        PyErr_Format(PyExc_ValueError, "PageMap: %s", why);
        goto out;
    }
    if (err < 0) {
        raise_errno(-err, "PageMap: %s", why);
        goto out;
    }
    self->m = m;
    self->pid = getpid();
    rc = 0;
out:
    free_dirs(paths, names, ndirs);
    PyBuffer_Release(&hashes);
    return rc;
}

static void PageMap_dealloc(PageMapObject *self)
{
    drop(self); /* no export nor hold can be left: each keeps a reference */
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *PageMap_close(PageMapObject *self, PyObject *unused)
{
    if (self->exports > 0 || self->holds > 0) {
        PyErr_Format(PyExc_BufferError,
                     "cannot close a PageMap while %zd buffer(s) over it are exported and "
                     "%d native user(s) hold it",
                     self->exports, self->holds);
        return NULL;
    }
    drop(self);
    Py_RETURN_NONE;
}

static PyObject *PageMap_stats(PageMapObject *self, PyObject *unused)
{
    struct mp *m = map_of(self);
    if (!m)
        return NULL;
    struct mp_stats st;
    mp_get_stats(m, &st);
#define U(x) (unsigned long long)(x)
    return Py_BuildValue("{s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:i}", "faults",
                         U(st.faults), "fills", U(st.fills), "evictions", U(st.evictions),
                         "resident_pages", U(st.resident_pages), "failures", U(st.failures),
                         "fill_ns", U(st.fill_ns), "read_ns", U(st.read_ns), "inflate_ns",
                         U(st.inflate_ns), "sha_ns", U(st.sha_ns), "copy_ns", U(st.copy_ns),
                         "asks", U(st.asks), "user_mode_only", st.user_mode_only);
#undef U
}

static PyObject *PageMap_failure(PageMapObject *self, void *closure)
{
    struct mp *m = map_of(self);
    if (!m)
        return NULL;
    const char *f = mp_failure(m);
    if (!f)
        Py_RETURN_NONE;
    return PyUnicode_DecodeFSDefault(f);
}

static PyObject *PageMap_address(PageMapObject *self, void *closure)
{
    struct mp *m = map_of(self);
    return m ? PyLong_FromVoidPtr(m) : NULL;
}

static PyObject *PageMap_base(PageMapObject *self, void *closure)
{
    struct mp *m = map_of(self);
    return m ? PyLong_FromVoidPtr(mp_base(m)) : NULL;
}

static PyObject *PageMap_closed(PageMapObject *self, void *closure)
{
    return PyBool_FromLong(self->m == NULL);
}

static int PageMap_getbuffer(PageMapObject *self, Py_buffer *view, int flags)
{
    struct mp *m = map_of(self);
    if (!m) {
        view->obj = NULL;
        return -1;
    }
    /* readonly = 1: a request for a writable buffer raises BufferError */
    if (PyBuffer_FillInfo(view, (PyObject *)self, mp_base(m), (Py_ssize_t)mp_size(m), 1,
                          flags) < 0)
        return -1;
    self->exports++;
    return 0;
}

static void PageMap_releasebuffer(PageMapObject *self, Py_buffer *view) { self->exports--; }

static PyMethodDef PageMap_methods[] = {
    {"close", (PyCFunction)PageMap_close, METH_NOARGS,
     "close(): stop the handlers and unmap; BufferError while exported or held"},
    {"stats", (PyCFunction)PageMap_stats, METH_NOARGS, "stats() -> dict of counters"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef PageMap_getset[] = {
    {"failure", (getter)PageMap_failure, NULL,
     "the first page that could not be loaded (one line), or None; sticky", NULL},
    {"address", (getter)PageMap_address, NULL, "the struct mp * (manifest_pager.h), as int",
     NULL},
    {"base", (getter)PageMap_base, NULL, "the region's address, as int", NULL},
    {"closed", (getter)PageMap_closed, NULL, "whether close() has run", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyBufferProcs PageMap_as_buffer = {(getbufferproc)PageMap_getbuffer,
                                          (releasebufferproc)PageMap_releasebuffer};

static PyTypeObject PageMapType = {
    /* the macro ends in a comma that clang-format cannot see */
    /* clang-format off */
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kspeedfs.manifest._pager.PageMap",
    /* clang-format on */
    .tp_basicsize = sizeof(PageMapObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc =
        "PageMap(size, page_size, hashes, dirs, cache_bytes, threads=2, ask=None, ask_ms=10000): a paged "
        "manifest's raw blob, filled on first touch (native/manifest_pager.h).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)PageMap_init,
    .tp_dealloc = (destructor)PageMap_dealloc,
    .tp_methods = PageMap_methods,
    .tp_getset = PageMap_getset,
    .tp_as_buffer = &PageMap_as_buffer,
};

/* ------------------------------------------------------------------------ C API */

static struct mp *capi_hold(void *obj)
{
    if (!PyObject_TypeCheck((PyObject *)obj, &PageMapType)) {
        PyErr_SetString(PyExc_TypeError, "not a kspeedfs.manifest._pager.PageMap");
        return NULL;
    }
    PageMapObject *self = obj;
    struct mp *m = map_of(self);
    if (m) {
        self->holds++;
        Py_INCREF(obj); /* nor may it be deallocated (which closes it) */
    }
    return m;
}

static void capi_release(void *obj)
{
    ((PageMapObject *)obj)->holds--;
    Py_DECREF((PyObject *)obj);
}

static const struct mp_capi CAPI = {
    .abi = MP_CAPI_ABI,
    .hold = capi_hold,
    .release = capi_release,
    .failed = mp_failed,
    .failure = mp_failure,
    .base = mp_base,
    .size = mp_size,
};

static struct PyModuleDef moddef = {
    PyModuleDef_HEAD_INIT,
    "kspeedfs.manifest._pager",
    "A paged manifest's raw blob, filled on first touch by userfaultfd "
    "(see native/manifest_pager.h).",
    -1,
    NULL,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC PyInit__pager(void)
{
    if (PyType_Ready(&PageMapType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&moddef);
    if (!m)
        return NULL;
    Py_INCREF(&PageMapType);
    PyModule_AddObject(m, "PageMap", (PyObject *)&PageMapType);
    PyModule_AddIntConstant(m, "HASH_LEN", MP_HASH_LEN);
    PyModule_AddIntConstant(m, "MAX_THREADS", MP_MAX_THREADS);
    PyObject *capi = PyCapsule_New((void *)&CAPI, MP_CAPI_NAME, NULL);
    if (!capi || PyModule_AddObject(m, "_C_API", capi) < 0) {
        Py_XDECREF(capi);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
