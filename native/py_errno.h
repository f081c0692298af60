/* py_errno.h — the one way the CPython bindings in native/ raise: OSError(errno, message),
 * the message printf-formatted by PyUnicode_FromFormat. Header-only (each binding is its
 * own extension module). Returns NULL, so a method can ``return raise_errno(...)``. */
#ifndef KSPEEDFS_PY_ERRNO_H
#define KSPEEDFS_PY_ERRNO_H

#include <Python.h>
#include <stdarg.h>

static PyObject *raise_errno(int err, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    PyObject *msg = PyUnicode_FromFormatV(fmt, ap);
    va_end(ap);
    PyObject *args = msg ? Py_BuildValue("(iN)", err, msg) : NULL;
    if (args) {
        PyErr_SetObject(PyExc_OSError, args);
        Py_DECREF(args);
    }
    return NULL;
}

#endif
