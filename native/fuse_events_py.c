/* fuse_events_py.c — what take() hands Python from the engine's queue: one named type
 * per kind (a structseq each: Read, Getxattr, Listxattr, Prefetch, Fetched), its fields
 * those of the kind's struct in struct fe_request (fe_read, fe_xattr, fe_prefetch,
 * fe_fetched: fuse_engine.h). */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include "fuse_engine_py.h"

#include <errno.h>
#include <stdarg.h>
#include <string.h>

#define MAX_TAKE 1024 /* requests per take() */

static PyStructSequence_Field read_fields[] = {
    {"fd", "the /dev/fuse fd to reply on, or a ring token (< 0)"},
    {"unique", "the kernel's id of the request"},
    {"entry", "the file's manifest entry (inode - 1)"},
    {"offset", NULL},
    {"size", NULL},
    {"random", "1: not continuing the previous READ of its handle"},
    {"since", "when it arrived (time.monotonic's clock)"},
    {NULL, NULL}};

static PyStructSequence_Field getxattr_fields[] = {
    {"fd", "the /dev/fuse fd to reply on, or a ring token (< 0)"},
    {"unique", "the kernel's id of the request"},
    {"entry", "the manifest entry (inode - 1)"},
    {"name", "the attribute's name (bytes)"},
    {"size", "the caller's buffer size (0: it asks for the value's size)"},
    {"since", "when it arrived (time.monotonic's clock)"},
    {NULL, NULL}};

static PyStructSequence_Field listxattr_fields[] = {
    {"fd", "the /dev/fuse fd to reply on, or a ring token (< 0)"},
    {"unique", "the kernel's id of the request"},
    {"entry", "the manifest entry (inode - 1)"},
    {"size", "the caller's buffer size (0: it asks for the list's size)"},
    {"since", "when it arrived (time.monotonic's clock)"},
    {NULL, NULL}};

static PyStructSequence_Field prefetch_fields[] = {
    {"reached", "the last chunk the hinting READ reached"},
    {"entry", "the file's manifest entry (inode - 1)"},
    {"first", "the first chunk to load"},
    {"stop", "the chunk after the last to load"},
    {NULL, NULL}};

static PyStructSequence_Field fetched_fields[] = {
    {"cookie", "the fetch's cookie (FETCH_OWN, FETCH_PART: one C started)"},
    {"chunk", "its chunk"},
    {"status", "FETCH_OK, a WC status (< 64), or another FETCH_*"},
    {"slot", "a C-started fetch's landing slot id"},
    {"peer", "a C-started fetch's peer"},
    {"path", "a C-started fetch's path to that peer"},
    {"since", "a C-started fetch's start (time.monotonic's clock)"},
    {NULL, NULL}};

static PyStructSequence_Desc descs[] = {
    {"kspeedfs.fuse._engine.Read", "A READ C did not answer: Python reads and replies.",
     read_fields, 7},
    {"kspeedfs.fuse._engine.Getxattr", "A GETXATTR for Python to answer.", getxattr_fields, 6},
    {"kspeedfs.fuse._engine.Listxattr", "A LISTXATTR for Python to answer.", listxattr_fields,
     5},
    {"kspeedfs.fuse._engine.Prefetch", "A sequential reader's chunks for Python to load.",
     prefetch_fields, 4},
    {"kspeedfs.fuse._engine.Fetched", "A native fetch that ended, or is late (FETCH_LATE).",
     fetched_fields, 7},
};

/* In descs' order; the names take() gives them in the module. */
static PyTypeObject event_types[5];
static const char *const event_names[5] = {"Read", "Getxattr", "Listxattr", "Prefetch",
                                           "Fetched"};

/* A ``type`` whose items Py_BuildValue(fmt, ...) makes (a tuple of its length). */
static PyObject *event_new(PyTypeObject *type, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    PyObject *t = Py_VaBuildValue(fmt, ap);
    va_end(ap);
    if (!t)
        return NULL;
    PyObject *ev = PyStructSequence_New(type);
    for (Py_ssize_t i = 0; ev && i < PyTuple_GET_SIZE(t); i++) {
        PyObject *o = PyTuple_GET_ITEM(t, i);
        Py_INCREF(o);
        PyStructSequence_SET_ITEM(ev, i, o);
    }
    Py_DECREF(t);
    return ev;
}

typedef unsigned long long ull; /* Py_BuildValue's "K" */

/* CLOCK_MONOTONIC ns as time.monotonic's seconds */
static double seconds(uint64_t ns) { return (double)ns / 1e9; }

static PyObject *event(const struct fe_request *r)
{
    const struct fe_read *rd = &r->read;
    const struct fe_xattr *x = &r->xattr;
    const struct fe_prefetch *p = &r->prefetch;
    const struct fe_fetched *f = &r->fetched;
    switch (r->kind) {
    case FE_READ:
        return event_new(&event_types[0], "(iKKKKid)", rd->fd, (ull)rd->unique, (ull)rd->entry,
                         (ull)rd->offset, (ull)rd->size, rd->random, seconds(rd->t0));
    case FE_GETXATTR:
        return event_new(&event_types[1], "(iKKy#Kd)", x->fd, (ull)x->unique, (ull)x->entry,
                         x->name, (Py_ssize_t)strnlen(x->name, 255), (ull)x->size,
                         seconds(x->t0));
    case FE_LISTXATTR:
        return event_new(&event_types[2], "(iKKKd)", x->fd, (ull)x->unique, (ull)x->entry,
                         (ull)x->size, seconds(x->t0));
    case FE_PREFETCH:
        return event_new(&event_types[3], "(KKKK)", (ull)p->reached, (ull)p->entry,
                         (ull)p->first, (ull)p->stop);
    case FE_FETCHED:
        return event_new(&event_types[4], "(KKiKiid)", (ull)f->cookie, (ull)f->chunk,
                         f->status, (ull)f->slot, f->peer, f->path, seconds(f->t0));
    }
    PyErr_Format(PyExc_SystemError, "take: a request of unknown kind %d", r->kind);
    return NULL;
}

static PyObject *request_list(const struct fe_request *reqs, size_t n)
{
    PyObject *list = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; list && i < n; i++) {
        PyObject *t = event(&reqs[i]);
        if (!t) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)i, t);
    }
    return list;
}

/* Taken requests Python will never see (out of memory): answer them EIO rather than
 * leave the kernel waiting. Hints and events (PREFETCH, FETCHED) need no answer. */
static void requests_fail(const struct fe_request *reqs, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        const struct fe_request *r = &reqs[i];
        if (r->kind == FE_READ)
            fe_reply_error(r->read.fd, r->read.unique, EIO);
        else if (r->kind == FE_GETXATTR || r->kind == FE_LISTXATTR)
            fe_reply_error(r->xattr.fd, r->xattr.unique, EIO);
    }
}

/* take(max=256) -> [events], oldest first. */
PyObject *Engine_take(EngineObject *self, PyObject *args)
{
    Py_ssize_t max = 256;
    if (!PyArg_ParseTuple(args, "|n:take", &max))
        return NULL;
    struct fe_engine *e = engine_of(self, "take");
    if (!e)
        return NULL;
    max = max < 1 ? 1 : max > MAX_TAKE ? MAX_TAKE : max;
    struct fe_request *reqs = PyMem_Malloc(sizeof *reqs * (size_t)max);
    if (!reqs)
        return PyErr_NoMemory();
    size_t n = fe_take(e, reqs, (size_t)max);
    PyObject *list = request_list(reqs, n);
    if (!list)
        requests_fail(reqs, n);
    PyMem_Free(reqs);
    return list;
}

int events_ready(PyObject *m)
{
    for (int i = 0; i < 5; i++) {
        if (PyStructSequence_InitType2(&event_types[i], &descs[i]) < 0)
            return -1;
        Py_INCREF(&event_types[i]);
        if (PyModule_AddObject(m, event_names[i], (PyObject *)&event_types[i]) < 0) {
            Py_DECREF(&event_types[i]);
            return -1;
        }
    }
    return 0;
}
