/* fetch_paths_py.h — a peer's paths as Python gives them to either fetch's binding
 * (fuse_fetch_py.c's fetch_peer, peer_wait_py.c's peer): a sequence of (engine handle,
 * qpn, raddr, rkey, nic). Header-only, as py_errno.h: each binding is its own module. */
#ifndef KSPEEDFS_FETCH_PATHS_PY_H
#define KSPEEDFS_FETCH_PATHS_PY_H

#include <Python.h>
#include <errno.h>

#include "fuse_fetch.h"
#include "py_errno.h"

/* Parse ``seq`` into ``out`` (at most FE_PATHS), each handle an index into ``held`` (of
 * ``nheld``): how many, or -1 with an exception set whose message starts ``who``. */
static Py_ssize_t fetch_paths_parse(PyObject *seq, ks_engine *const *held, int nheld,
                                    struct fe_path *out, const char *who)
{
    PyObject *fast = PySequence_Fast(seq, "paths must be a sequence");
    if (!fast)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (n > FE_PATHS) {
        Py_DECREF(fast);
        raise_errno(EINVAL, "%s: more than %d paths", who, FE_PATHS);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int handle;
        unsigned int qpn, rkey, nic;
        unsigned long long raddr;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "iIKII", &handle, &qpn,
                              &raddr, &rkey, &nic)) {
            Py_DECREF(fast);
            return -1;
        }
        if (handle < 0 || handle >= nheld) {
            Py_DECREF(fast);
            raise_errno(EINVAL, "%s: no such engine handle", who);
            return -1;
        }
        out[i] = (struct fe_path){.ke = held[handle],
                                  .qpn = qpn,
                                  .rkey = rkey,
                                  .nic = nic,
                                  .raddr = raddr};
    }
    Py_DECREF(fast);
    return n;
}

#endif
