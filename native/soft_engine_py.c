/* soft_engine_py.c — the CPython binding of the soft engine: module rdma._soft_engine.
 *
 * Every method has the same shape: parse its arguments, find its object under e->lock
 * with one of the helpers below (engine_locked, mr_locked, cq_locked, qp_locked), call
 * the engine (soft_engine.h), drop the lock once, then reply.  A helper that fails has
 * raised the OSError and holds no lock, so the method just returns NULL.  The hot-path
 * calls (post_send, post_recv, poll_cq, modify_cq) take their engine lock inside the
 * engine call instead.
 *
 * The GIL: waiting for e->lock drops it (lock_nogil: the engine thread may hold the lock
 * for a bounded socket operation); the work under the lock keeps it, except posting
 * (post_send, post_recv: the whole call runs without it) and close.  Polling and
 * moderation hold only e->cq_tab_lock, for a table lookup and a ring copy, and keep it.
 *
 * Errors are OSError(errno, "<method>: <reason>"); rdma/providers/soft/engine.py turns
 * them into the rdma.errors tree.  A closed engine is EBADF.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <arpa/inet.h>
#include <errno.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <stdarg.h>
#include <stdlib.h>

#include "soft_engine.h"
#include "py_errno.h"

typedef struct {
    PyObject_HEAD
    ks_engine *e; /* NULL once closed; the GIL guards the pointer */
    int holds;    /* C API users (capi_hold); close refuses while any; GIL */
} EngineObject;

/* ------------------------------------------------------------------------ replies */

/* An engine call's result: None, or its error (MemoryError for -ENOMEM without a why). */
static PyObject *reply_none(int rc, const char *why)
{
    if (rc >= 0)
        Py_RETURN_NONE;
    if (!why)
        return PyErr_NoMemory();
    return raise_errno(-rc, "%s", why);
}

/* ------------------------------------------------------------- lookups under lock */

/* Take e->lock without holding the GIL while waiting (the engine thread may hold it
 * for a bounded socket operation). */
static void lock_nogil(ks_engine *e)
{
    if (ks_engine_trylock(e) == 0)
        return;
    Py_BEGIN_ALLOW_THREADS
    ks_engine_lock(e);
    Py_END_ALLOW_THREADS
}

static ks_engine *engine_of(EngineObject *self)
{
    if (!self->e)
        raise_errno(EBADF, "engine is closed");
    return self->e;
}

/* The engine with e->lock held, or NULL (EBADF: closed). */
static ks_engine *engine_locked(EngineObject *self)
{
    ks_engine *e = engine_of(self);
    if (e)
        lock_nogil(e);
    return e;
}

/* QP `qpn` with e->lock held, or NULL and no lock (EBADF, EINVAL: no such QP). */
static ks_qp *qp_locked(EngineObject *self, unsigned int qpn, const char *what)
{
    ks_engine *e = engine_locked(self);
    ks_qp *qp = e ? ks_qp_get(e, qpn) : NULL;
    if (e && !qp) {
        ks_engine_unlock(e);
        raise_errno(EINVAL, "%s: unknown QP", what);
    }
    return qp;
}

/* MR `key` with e->lock held, or NULL and no lock (EBADF, EINVAL: no such key). */
static ks_mr *mr_locked(EngineObject *self, unsigned int key, const char *what)
{
    ks_engine *e = engine_locked(self);
    ks_mr *mr = e ? ks_mr_get(e, key) : NULL;
    if (e && !mr) {
        ks_engine_unlock(e);
        raise_errno(EINVAL, "%s: unknown key", what);
    }
    return mr;
}

/* The engine, once `id` is a possible CQ id (EBADF, EINVAL: out of range). */
static ks_engine *cq_engine(EngineObject *self, int id, const char *what)
{
    ks_engine *e = engine_of(self);
    if (e && (id < 0 || id >= KS_MAX_CQ)) {
        raise_errno(EINVAL, "%s: bad id", what);
        e = NULL;
    }
    return e;
}

/* CQ `id` with e->lock held (to destroy it), or NULL and no lock (EINVAL: unknown). */
static ks_cq *cq_locked(EngineObject *self, int id, const char *what)
{
    ks_engine *e = cq_engine(self, id, what);
    if (e)
        lock_nogil(e);
    ks_cq *cq = e ? ks_cq_get(e, id) : NULL;
    if (e && !cq) {
        ks_engine_unlock(e);
        raise_errno(EINVAL, "%s: unknown CQ", what);
    }
    return cq;
}

/* ------------------------------------------------------------------------- engine */

static void Engine_dealloc(EngineObject *self)
{
    ks_engine *e = self->e;
    self->e = NULL;
    Py_BEGIN_ALLOW_THREADS
    ks_engine_close(e);
    Py_END_ALLOW_THREADS
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int Engine_init(EngineObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"ip", "port", NULL};
    const char *ip, *why;
    int port = 0;
    struct in_addr addr;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "s|i", kwlist, &ip, &port))
        return -1;
    if (self->e) {
        PyErr_SetString(PyExc_RuntimeError, "Engine already initialised");
        return -1;
    }
    if (inet_pton(AF_INET, ip, &addr) != 1) {
        PyErr_Format(PyExc_ValueError, "not an IPv4 address: %s", ip);
        return -1;
    }
    int rc = ks_engine_open(addr.s_addr, port, &self->e, &why);
    if (rc < 0) {
        reply_none(rc, why);
        return -1;
    }
    return 0;
}

static PyObject *Engine_close(EngineObject *self, PyObject *unused)
{
    if (self->holds)
        return raise_errno(EBUSY, "close: held by %d native user(s)", self->holds);
    ks_engine *e = self->e;
    self->e = NULL;
    Py_BEGIN_ALLOW_THREADS
    ks_engine_close(e);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *Engine_port(EngineObject *self, void *closure)
{
    ks_engine *e = engine_of(self);
    return e ? PyLong_FromLong(ks_engine_port(e)) : NULL;
}

static PyObject *Engine_stats(EngineObject *self, PyObject *unused)
{
    struct ks_stats st;
    ks_engine *e = engine_locked(self);
    if (!e)
        return NULL;
    ks_engine_stats(e, &st);
    ks_engine_unlock(e);
    return Py_BuildValue("{s:K,s:K,s:K,s:i,s:i,s:i,s:K,s:K,s:K,s:K}", "dropped_conns",
                         (unsigned long long)st.dropped_conns, "rx_bytes",
                         (unsigned long long)st.rx_bytes, "tx_bytes",
                         (unsigned long long)st.tx_bytes, "conns", st.conns, "qps", st.qps,
                         "pending_hello", st.pending_hello, "hello_evicted",
                         (unsigned long long)st.hello_evicted, "hello_timeouts",
                         (unsigned long long)st.hello_timeouts, "hello_refused",
                         (unsigned long long)st.hello_refused, "doorbell_posts",
                         (unsigned long long)st.doorbell_posts);
}

/* ---------------------------------------------------------------------------- MRs */

static PyObject *Engine_reg_mr(EngineObject *self, PyObject *args)
{
    int pd, access;
    unsigned long long addr, length;
    ks_mr *mr;
    const char *why;
    if (!PyArg_ParseTuple(args, "iKKi", &pd, &addr, &length, &access))
        return NULL;
    ks_engine *e = engine_of(self);
    if (!e)
        return NULL;
    int rc = ks_mr_new(pd, addr, length, access, &mr, &why);
    if (rc < 0)
        return reply_none(rc, why);
    lock_nogil(e);
    uint32_t key = ks_mr_add(e, mr);
    ks_engine_unlock(e);
    if (!key) {
        ks_mr_free(mr);
        return raise_errno(ENOMEM, "reg_mr: too many MRs");
    }
    return PyLong_FromUnsignedLong(key);
}

static PyObject *Engine_dereg_mr(EngineObject *self, PyObject *args)
{
    unsigned int key;
    if (!PyArg_ParseTuple(args, "I", &key))
        return NULL;
    ks_mr *mr = mr_locked(self, key, "dereg_mr");
    if (!mr)
        return NULL;
    ks_mr_dereg(self->e, mr);
    ks_engine_unlock(self->e);
    ks_mr_free(mr);
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------------------- CQs */

static PyObject *Engine_create_cq(EngineObject *self, PyObject *args)
{
    int cqe;
    ks_cq *cq;
    const char *why;
    if (!PyArg_ParseTuple(args, "i", &cqe))
        return NULL;
    ks_engine *e = engine_of(self);
    if (!e)
        return NULL;
    int rc = ks_cq_new(cqe, &cq, &why);
    if (rc < 0)
        return reply_none(rc, why);
    lock_nogil(e);
    int id = ks_cq_add(e, cq);
    ks_engine_unlock(e);
    if (id < 0) {
        ks_cq_free(cq);
        return raise_errno(ENOMEM, "create_cq: too many CQs");
    }
    return Py_BuildValue("(ii)", id, ks_cq_efd(cq));
}

static PyObject *Engine_destroy_cq(EngineObject *self, PyObject *args)
{
    int id;
    const char *why;
    if (!PyArg_ParseTuple(args, "i", &id))
        return NULL;
    ks_cq *cq = cq_locked(self, id, "destroy_cq");
    if (!cq)
        return NULL;
    int rc = ks_cq_remove(self->e, cq, &why);
    ks_engine_unlock(self->e);
    if (rc == 0)
        ks_cq_free(cq);
    return reply_none(rc, why);
}

/* modify_cq(id, cq_count, cq_period_us): completion moderation (ibv_modify_cq). */
static PyObject *Engine_modify_cq(EngineObject *self, PyObject *args)
{
    int id;
    unsigned int count, period_us;
    const char *why;
    if (!PyArg_ParseTuple(args, "iII", &id, &count, &period_us))
        return NULL;
    ks_engine *e = cq_engine(self, id, "modify_cq");
    if (!e)
        return NULL;
    int rc = ks_cq_moderate(e, id, count, period_us, &why);
    return reply_none(rc, why);
}

static PyObject *wc_list(const ks_wc *wc, int n)
{
    PyObject *list = PyList_New(n);
    for (int i = 0; list && i < n; i++) {
        PyObject *t = Py_BuildValue("(KIIIII)", (unsigned long long)wc[i].wr_id, wc[i].status,
                                    wc[i].opcode, wc[i].byte_len, wc[i].qp_num,
                                    wc[i].vendor_err);
        if (!t) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, i, t);
    }
    return list;
}

static PyObject *Engine_poll_cq(EngineObject *self, PyObject *args)
{
    int id, num;
    ks_wc local[64];
    const char *why;
    if (!PyArg_ParseTuple(args, "ii", &id, &num))
        return NULL;
    ks_engine *e = cq_engine(self, id, "poll_cq");
    if (!e)
        return NULL;
    num = num < 1 ? 1 : num > 4096 ? 4096 : num;
    ks_wc *wc = num <= 64 ? local : malloc(sizeof(ks_wc) * num);
    if (!wc)
        return PyErr_NoMemory();
    int got = ks_cq_poll(e, id, wc, num, &why);
    PyObject *list = got < 0 ? reply_none(got, why) : wc_list(wc, got);
    if (wc != local)
        free(wc);
    return list;
}

/* ---------------------------------------------------------------------------- QPs */

static PyObject *Engine_create_qp(EngineObject *self, PyObject *args)
{
    struct ks_qp_attr a;
    ks_qp *qp;
    const char *why;
    if (!PyArg_ParseTuple(args, "iiiIIIIp", &a.pd, &a.scq, &a.rcq, &a.max_send_wr,
                          &a.max_recv_wr, &a.max_send_sge, &a.max_recv_sge, &a.sig_all))
        return NULL;
    ks_engine *e = engine_of(self);
    if (!e)
        return NULL;
    int rc = ks_qp_new(&a, &qp, &why);
    if (rc < 0)
        return reply_none(rc, why);
    lock_nogil(e);
    int qpn = ks_qp_add(e, qp, &a, &why);
    ks_engine_unlock(e);
    if (qpn < 0) {
        ks_qp_free(qp);
        return reply_none(qpn, why);
    }
    return PyLong_FromUnsignedLong((unsigned long)qpn);
}

static PyObject *Engine_destroy_qp(EngineObject *self, PyObject *args)
{
    unsigned int qpn;
    if (!PyArg_ParseTuple(args, "I", &qpn))
        return NULL;
    ks_qp *qp = qp_locked(self, qpn, "destroy_qp");
    if (!qp)
        return NULL;
    ks_qp_remove(self->e, qp);
    ks_engine_unlock(self->e);
    ks_qp_free(qp);
    Py_RETURN_NONE;
}

static PyObject *Engine_qp_state(EngineObject *self, PyObject *args)
{
    unsigned int qpn;
    if (!PyArg_ParseTuple(args, "I", &qpn))
        return NULL;
    ks_qp *qp = qp_locked(self, qpn, "qp_state");
    if (!qp)
        return NULL;
    int state = ks_qp_state(qp);
    ks_engine_unlock(self->e);
    return PyLong_FromLong(state);
}

static PyObject *Engine_qp_rx_age(EngineObject *self, PyObject *args)
{
    unsigned int qpn;
    if (!PyArg_ParseTuple(args, "I", &qpn))
        return NULL;
    ks_qp *qp = qp_locked(self, qpn, "qp_rx_age");
    if (!qp)
        return NULL;
    int64_t age = ks_qp_rx_age(qp);
    ks_engine_unlock(self->e);
    if (age < 0)
        Py_RETURN_NONE;
    return PyFloat_FromDouble((double)age / 1e9);
}

static PyObject *Engine_qp_private_data(EngineObject *self, PyObject *args)
{
    unsigned int qpn;
    uint8_t buf[KS_MAX_PDATA];
    if (!PyArg_ParseTuple(args, "I", &qpn))
        return NULL;
    ks_qp *qp = qp_locked(self, qpn, "qp_private_data");
    if (!qp)
        return NULL;
    int n = ks_qp_private_data(qp, buf);
    ks_engine_unlock(self->e);
    if (n < 0)
        Py_RETURN_NONE;
    return PyBytes_FromStringAndSize((const char *)buf, n);
}

static PyObject *Engine_qp_init(EngineObject *self, PyObject *args)
{
    unsigned int qpn;
    int access;
    if (!PyArg_ParseTuple(args, "Ii", &qpn, &access))
        return NULL;
    ks_qp *qp = qp_locked(self, qpn, "qp_init");
    if (!qp)
        return NULL;
    ks_qp_init(qp, access);
    ks_engine_unlock(self->e);
    Py_RETURN_NONE;
}

static PyObject *Engine_qp_set_access(EngineObject *self, PyObject *args)
{
    unsigned int qpn;
    int access;
    if (!PyArg_ParseTuple(args, "Ii", &qpn, &access))
        return NULL;
    ks_qp *qp = qp_locked(self, qpn, "qp_set_access");
    if (!qp)
        return NULL;
    ks_qp_set_access(qp, access);
    ks_engine_unlock(self->e);
    Py_RETURN_NONE;
}

/* qp_expect(qpn, src_qpn, ip, private_data or None): see ks_qp_expect. */
static PyObject *Engine_qp_expect(EngineObject *self, PyObject *args)
{
    unsigned int qpn, src, ip;
    PyObject *pd_obj, *ret = NULL;
    Py_buffer pd = {0};
    const char *why;
    if (!PyArg_ParseTuple(args, "IIIO", &qpn, &src, &ip, &pd_obj))
        return NULL;
    if (pd_obj != Py_None && PyObject_GetBuffer(pd_obj, &pd, PyBUF_SIMPLE) < 0)
        return NULL;
    int pd_len = pd_obj == Py_None       ? -1               /* None: any private data */
                 : pd.len > KS_MAX_PDATA ? KS_MAX_PDATA + 1 /* too long: ks_qp_expect says */
                                         : (int)pd.len;
    ks_qp *qp = qp_locked(self, qpn, "qp_expect");
    if (qp) {
        int rc = ks_qp_expect(self->e, qp, src, ip, pd.buf, pd_len, &why);
        ks_engine_unlock(self->e);
        ret = reply_none(rc, why);
    }
    PyBuffer_Release(&pd);
    return ret;
}

/* INIT -> RTR: adopt the connected (HELLO-acknowledged) requester socket `fd`. */
static PyObject *Engine_qp_rtr(EngineObject *self, PyObject *args)
{
    unsigned int qpn, dest, rq_psn;
    int fd;
    const char *why;
    if (!PyArg_ParseTuple(args, "IiII", &qpn, &fd, &dest, &rq_psn))
        return NULL;
    ks_qp *qp = qp_locked(self, qpn, "qp_rtr");
    if (!qp)
        return NULL;
    int rc = ks_qp_to_rtr(self->e, qp, fd, dest, rq_psn, &why);
    ks_engine_unlock(self->e);
    return reply_none(rc, why);
}

static PyObject *Engine_qp_rts(EngineObject *self, PyObject *args)
{
    unsigned int qpn, sq_psn;
    unsigned long long timeout_ns;
    int set_psn;
    const char *why;
    if (!PyArg_ParseTuple(args, "IIKp", &qpn, &sq_psn, &timeout_ns, &set_psn))
        return NULL;
    ks_qp *qp = qp_locked(self, qpn, "qp_rts");
    if (!qp)
        return NULL;
    int rc = ks_qp_to_rts(qp, sq_psn, timeout_ns, set_psn, &why);
    ks_engine_unlock(self->e);
    if (rc == 0)
        ks_engine_kick(self->e); /* it may sleep up to 1 s with no timer: re-plan */
    return reply_none(rc, why);
}

static PyObject *Engine_qp_reset(EngineObject *self, PyObject *args)
{
    unsigned int qpn;
    if (!PyArg_ParseTuple(args, "I", &qpn))
        return NULL;
    ks_qp *qp = qp_locked(self, qpn, "qp_reset");
    if (!qp)
        return NULL;
    ks_qp_to_reset(self->e, qp);
    ks_engine_unlock(self->e);
    Py_RETURN_NONE;
}

static PyObject *Engine_qp_err(EngineObject *self, PyObject *args)
{
    unsigned int qpn;
    if (!PyArg_ParseTuple(args, "I", &qpn))
        return NULL;
    ks_qp *qp = qp_locked(self, qpn, "qp_err");
    if (!qp)
        return NULL;
    ks_qp_to_err(self->e, qp);
    ks_engine_unlock(self->e);
    Py_RETURN_NONE;
}

/* --------------------------------------------------------------------- posting WRs */

/* [(addr, length, lkey), ...] into out[0..max) */
static int parse_sges(PyObject *seq, ks_sge *out, uint32_t max, uint32_t *n, uint64_t *total)
{
    PyObject *fast = PySequence_Fast(seq, "sg_list must be a sequence");
    if (!fast)
        return -1;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(fast);
    int rc = 0;
    if ((uint64_t)len > max) {
        raise_errno(EINVAL, "too many SGEs");
        rc = -1;
    }
    *total = 0;
    for (Py_ssize_t i = 0; i < len && rc == 0; i++) {
        unsigned long long addr;
        unsigned int length, lkey;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "KII", &addr, &length,
                              &lkey)) {
            rc = -1;
            break;
        }
        out[i] = (ks_sge){.addr = addr, .length = length, .lkey = lkey};
        *total += length;
    }
    *n = (uint32_t)len;
    Py_DECREF(fast);
    return rc;
}

/* (wr_id, opcode, flags, remote_addr, rkey, sg_list) -> a send WQE; -1: exception set */
static int parse_send_wr(PyObject *item, void *out)
{
    ks_wqe *w = out;
    unsigned long long wr_id, raddr;
    unsigned int opcode, flags, rkey;
    PyObject *sges;
    if (!PyArg_ParseTuple(item, "KIIKIO", &wr_id, &opcode, &flags, &raddr, &rkey, &sges) ||
        parse_sges(sges, w->sge, KS_MAX_SGE, &w->nsge, &w->total) < 0)
        return -1;
    if ((opcode != KS_WR_RDMA_READ && opcode != KS_WR_SEND) ||
        (opcode == KS_WR_RDMA_READ && w->total > KS_MAX_MSG) ||
        (opcode == KS_WR_SEND && w->total > KS_MAX_SEND)) {
        raise_errno(EINVAL, "post_send: unsupported opcode or message too long");
        return -1;
    }
    w->wr_id = wr_id;
    w->opcode = opcode;
    w->flags = flags;
    w->raddr = raddr;
    w->rkey = rkey;
    w->cq = NULL;
    return 0;
}

/* (wr_id, sg_list) -> a receive WQE; -1: exception set */
static int parse_recv_wr(PyObject *item, void *out)
{
    ks_rwqe *r = out;
    unsigned long long wr_id;
    PyObject *sges;
    if (!PyArg_ParseTuple(item, "KO", &wr_id, &sges) ||
        parse_sges(sges, r->sge, KS_MAX_SGE, &r->nsge, &r->total) < 0)
        return -1;
    r->wr_id = wr_id;
    return 0;
}

/* A sequence of WRs -> an array of `size`-byte WQEs: `one` when there is at most one,
 * else malloc'd (the caller frees it when it is not `one`); NULL with an exception. */
static void *parse_wrs(PyObject *wrs, const char *what, size_t size,
                       int (*parse_wr)(PyObject *item, void *out), void *one, Py_ssize_t *n)
{
    PyObject *fast = PySequence_Fast(wrs, what);
    if (!fast)
        return NULL;
    *n = PySequence_Fast_GET_SIZE(fast);
    char *tmp = *n <= 1 ? one : malloc(size * (size_t)*n);
    if (!tmp)
        PyErr_NoMemory();
    for (Py_ssize_t i = 0; tmp && i < *n; i++) {
        if (parse_wr(PySequence_Fast_GET_ITEM(fast, i), tmp + size * (size_t)i) < 0) {
            if (tmp != one)
                free(tmp);
            tmp = NULL;
        }
    }
    Py_DECREF(fast);
    return tmp;
}

/* post_send(qpn, [(wr_id, opcode, flags, remote_addr, rkey, [(addr, len, lkey), ...]), ...]) */
static PyObject *Engine_post_send(EngineObject *self, PyObject *args)
{
    unsigned int qpn;
    PyObject *wrs;
    ks_wqe one, *w;
    Py_ssize_t n;
    const char *why = NULL;
    int rc;
    if (!PyArg_ParseTuple(args, "IO", &qpn, &wrs))
        return NULL;
    ks_engine *e = engine_of(self);
    if (!e || !(w = parse_wrs(wrs, "post_send needs a sequence of WRs", sizeof one,
                              parse_send_wr, &one, &n)))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = ks_post_send(e, qpn, w, (size_t)n, &why);
    Py_END_ALLOW_THREADS
    if (w != &one)
        free(w);
    return reply_none(rc, why);
}

/* post_recv(qpn, [(wr_id, [(addr, len, lkey), ...]), ...]) */
static PyObject *Engine_post_recv(EngineObject *self, PyObject *args)
{
    unsigned int qpn;
    PyObject *wrs;
    ks_rwqe one, *r;
    Py_ssize_t n;
    const char *why = NULL;
    int rc;
    if (!PyArg_ParseTuple(args, "IO", &qpn, &wrs))
        return NULL;
    ks_engine *e = engine_of(self);
    if (!e || !(r = parse_wrs(wrs, "post_recv needs a sequence of WRs", sizeof one,
                              parse_recv_wr, &one, &n)))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = ks_post_recv(e, qpn, r, (size_t)n, &why);
    Py_END_ALLOW_THREADS
    if (r != &one)
        free(r);
    return reply_none(rc, why);
}

/* ------------------------------------------------------------------ the operations */

static PyMethodDef Engine_methods[] = {
    {"close", (PyCFunction)Engine_close, METH_NOARGS, "Stop the engine thread, free all."},
    {"stats", (PyCFunction)Engine_stats, METH_NOARGS, "Counters (dict)."},
    {"reg_mr", (PyCFunction)Engine_reg_mr, METH_VARARGS,
     "reg_mr(pd, addr, length, access) -> key"},
    {"dereg_mr", (PyCFunction)Engine_dereg_mr, METH_VARARGS, "dereg_mr(key)"},
    {"create_cq", (PyCFunction)Engine_create_cq, METH_VARARGS,
     "create_cq(cqe) -> (id, eventfd)"},
    {"destroy_cq", (PyCFunction)Engine_destroy_cq, METH_VARARGS, "destroy_cq(id)"},
    {"poll_cq", (PyCFunction)Engine_poll_cq, METH_VARARGS, "poll_cq(id, n) -> [wc tuples]"},
    {"modify_cq", (PyCFunction)Engine_modify_cq, METH_VARARGS,
     "modify_cq(id, cq_count, cq_period_us): completion moderation"},
    {"create_qp", (PyCFunction)Engine_create_qp, METH_VARARGS,
     "create_qp(pd, scq, rcq, max_send_wr, max_recv_wr, max_send_sge, max_recv_sge, sig_all) -> qpn"},
    {"destroy_qp", (PyCFunction)Engine_destroy_qp, METH_VARARGS, "destroy_qp(qpn)"},
    {"qp_state", (PyCFunction)Engine_qp_state, METH_VARARGS, "qp_state(qpn) -> int"},
    {"qp_rx_age", (PyCFunction)Engine_qp_rx_age, METH_VARARGS,
     "qp_rx_age(qpn) -> seconds since a response byte arrived, or None (never)"},
    {"qp_private_data", (PyCFunction)Engine_qp_private_data, METH_VARARGS, "bytes or None"},
    {"qp_init", (PyCFunction)Engine_qp_init, METH_VARARGS, "qp_init(qpn, access)"},
    {"qp_set_access", (PyCFunction)Engine_qp_set_access, METH_VARARGS,
     "qp_set_access(qpn, access)"},
    {"qp_expect", (PyCFunction)Engine_qp_expect, METH_VARARGS,
     "qp_expect(qpn, src_qpn, ip_be32, private_data or None)"},
    {"qp_rtr", (PyCFunction)Engine_qp_rtr, METH_VARARGS, "qp_rtr(qpn, fd, dest_qpn, rq_psn)"},
    {"qp_rts", (PyCFunction)Engine_qp_rts, METH_VARARGS,
     "qp_rts(qpn, sq_psn, timeout_ns, set_psn)"},
    {"qp_reset", (PyCFunction)Engine_qp_reset, METH_VARARGS, "qp_reset(qpn)"},
    {"qp_err", (PyCFunction)Engine_qp_err, METH_VARARGS, "qp_err(qpn)"},
    {"post_send", (PyCFunction)Engine_post_send, METH_VARARGS, "post_send(qpn, wrs)"},
    {"post_recv", (PyCFunction)Engine_post_recv, METH_VARARGS, "post_recv(qpn, wrs)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Engine_getset[] = {
    {"port", (getter)Engine_port, NULL, "TCP port of the device listener", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject EngineType = {
    /* the macro ends in a comma that clang-format cannot see */
    /* clang-format off */
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "rdma._soft_engine.Engine",
    /* clang-format on */
    .tp_basicsize = sizeof(EngineObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Native soft-RDMA engine for one device (listener + epoll thread).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Engine_init,
    .tp_dealloc = (destructor)Engine_dealloc,
    .tp_methods = Engine_methods,
    .tp_getset = Engine_getset,
};

/* ------------------------------------------------------------------------ C API */

static ks_engine *capi_hold(void *obj)
{
    EngineObject *self = obj;
    if (!PyObject_TypeCheck((PyObject *)obj, &EngineType)) {
        PyErr_SetString(PyExc_TypeError, "not an rdma._soft_engine.Engine");
        return NULL;
    }
    ks_engine *e = engine_of(self);
    if (e) {
        self->holds++;
        Py_INCREF(obj); /* nor may it be deallocated (which closes it) */
    }
    return e;
}

static void capi_release(void *obj)
{
    ((EngineObject *)obj)->holds--;
    Py_DECREF((PyObject *)obj);
}

static int capi_cq_open(ks_engine *e, int cqe, ks_cq **out, int *id, int *efd,
                        const char **why)
{
    ks_cq *cq;
    int rc = ks_cq_new(cqe, &cq, why);
    if (rc < 0)
        return rc;
    ks_engine_lock(e);
    rc = ks_cq_add(e, cq);
    ks_engine_unlock(e);
    if (rc < 0) {
        ks_cq_free(cq);
        *why = "cq_open: no free CQ id";
        return rc;
    }
    *out = cq;
    *id = rc;
    *efd = ks_cq_efd(cq);
    return 0;
}

static int capi_cq_close(ks_engine *e, ks_cq *cq, const char **why)
{
    ks_engine_lock(e);
    int rc = ks_cq_remove(e, cq, why);
    ks_engine_unlock(e);
    if (rc == 0)
        ks_cq_free(cq);
    return rc;
}

static const struct ks_capi CAPI = {
    .abi = KS_CAPI_ABI,
    .hold = capi_hold,
    .release = capi_release,
    .post_send = ks_post_send,
    .cq_open = capi_cq_open,
    .cq_close = capi_cq_close,
    .cq_poll = ks_cq_poll,
};

/* ---------------------------------------------------------------- module functions */

static PyObject *mod_interfaces(PyObject *m, PyObject *unused)
{
    struct ifaddrs *ifa0;
    if (getifaddrs(&ifa0) < 0)
        return raise_errno(errno, "getifaddrs");
    PyObject *list = PyList_New(0);
    for (struct ifaddrs *ifa = ifa0; list && ifa; ifa = ifa->ifa_next) {
        if (!ifa->ifa_addr || ifa->ifa_addr->sa_family != AF_INET)
            continue;
        char buf[INET_ADDRSTRLEN];
        inet_ntop(AF_INET, &((struct sockaddr_in *)ifa->ifa_addr)->sin_addr, buf, sizeof buf);
        PyObject *t = Py_BuildValue("(ssI)", ifa->ifa_name, buf, ifa->ifa_flags);
        if (!t || PyList_Append(list, t) < 0)
            Py_CLEAR(list);
        Py_XDECREF(t);
    }
    freeifaddrs(ifa0);
    return list;
}

static PyObject *mod_parse_header(PyObject *m, PyObject *args)
{
    Py_buffer b;
    int role, rc = -EPROTO;
    struct ks_hdr h;
    if (!PyArg_ParseTuple(args, "y*i", &b, &role))
        return NULL;
    int truncated = b.len < KS_HDR_LEN;
    if (!truncated)
        rc = ks_hdr_parse(b.buf, &h, role);
    PyBuffer_Release(&b);
    if (rc < 0)
        return raise_errno(-rc, truncated ? "truncated header" : "bad header");
    return Py_BuildValue("{s:i,s:i,s:I,s:I,s:I,s:I,s:K}", "opcode", h.opcode, "status",
                         h.status, "psn", h.psn, "length", h.length, "rkey", h.rkey, "rlen",
                         h.rlen, "raddr", (unsigned long long)h.raddr);
}

static PyMethodDef mod_methods[] = {
    {"interfaces", mod_interfaces, METH_NOARGS, "[(ifname, ipv4, flags)] from getifaddrs()"},
    {"parse_header", mod_parse_header, METH_VARARGS,
     "parse_header(buf, role) -> dict; OSError(EPROTO/EMSGSIZE) when invalid"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {
    PyModuleDef_HEAD_INIT,
    "rdma._soft_engine",
    "Native data path of the soft RDMA provider (see native/soft_engine.h).",
    -1,
    mod_methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC PyInit__soft_engine(void)
{
    if (PyType_Ready(&EngineType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&moddef);
    if (!m)
        return NULL;
    Py_INCREF(&EngineType);
    PyModule_AddObject(m, "Engine", (PyObject *)&EngineType);
    PyModule_AddIntConstant(m, "HDR_LEN", KS_HDR_LEN);
    PyModule_AddIntConstant(m, "MAGIC", KS_MAGIC);
    PyModule_AddIntConstant(m, "VERSION", KS_VERSION);
    PyModule_AddIntConstant(m, "MAX_MSG", KS_MAX_MSG);
    PyModule_AddIntConstant(m, "MAX_SEND", KS_MAX_SEND);
    PyModule_AddIntConstant(m, "MAX_PDATA", KS_MAX_PDATA);
    PyModule_AddIntConstant(m, "MAX_SGE", KS_MAX_SGE);
    PyModule_AddIntConstant(m, "MAX_WR", KS_MAX_WR);
    PyModule_AddIntConstant(m, "ROLE_RESPONSES", KS_ROLE_RESPONSES);
    PyModule_AddIntConstant(m, "ROLE_REQUESTS", KS_ROLE_REQUESTS);
    PyModule_AddIntConstant(m, "ROLE_HELLO", KS_ROLE_HELLO);
    PyModule_AddIntConstant(m, "ROLE_ANY", KS_ROLE_ANY);
    PyObject *capi = PyCapsule_New((void *)&CAPI, KS_CAPI_NAME, NULL);
    if (!capi || PyModule_AddObject(m, "_C_API", capi) < 0) {
        Py_XDECREF(capi);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
