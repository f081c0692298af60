/* fuse_engine_py.h — what crosses the binding's files: the Engine object and the
 * functions one file defines and another calls (fuse_engine_py.c: the module and the
 * Engine type; fuse_events_py.c: take() and its event types; fuse_fetch_py.c: Engine's
 * methods for the native fetch, and the Block type).
 * The includer defines PY_SSIZE_T_CLEAN first.
 */
#ifndef KSPEEDFS_FUSE_ENGINE_PY_H
#define KSPEEDFS_FUSE_ENGINE_PY_H

#include <Python.h>

#include <stdint.h>

#include "fuse_engine.h"
#include "fuse_fetch.h"

/* The index arrays an Engine holds a view of (IX_ARRAYS in fuse_engine_py.c). */
enum {
    IX_PARENT,
    IX_MODE,
    IX_UID,
    IX_GID,
    IX_SIZE,
    IX_MTIME_NS,
    IX_NAME_OFF,
    IX_NAME_LEN,
    IX_DATA,
    IX_EXT,
    IX_CHUNK_LEN,
    IX_NAMES,
    IX_EXT_DIGESTS,
    IX_CHUNK_DIGESTS,
    IX_BLOCK_DIGESTS,
    IX_N
};

typedef struct {
    PyObject_HEAD
    struct fe_engine *e;   /* NULL until created and once closed; the GIL guards it */
    Py_buffer views[IX_N]; /* the index arrays, views[0..nviews) held */
    int nviews;
    int initialised; /* fe_init succeeded */
    int started;     /* fe_start succeeded */
    int busy;        /* init or join is running without the GIL */
    /* the native fetch: the soft engines it holds (rdma._soft_engine.Engine objects,
     * held through the C API until fetch_stop) */
    const struct ks_capi *capi;
    PyObject *held[FE_FETCH_ENGINES];
    ks_engine *held_e[FE_FETCH_ENGINES];
    int nheld;
    /* a paged manifest's PageMap, held through its C API (manifest_pager.h) until teardown */
    PyObject *pages;
} EngineObject;

#pragma GCC visibility push(hidden)

/* fuse_engine_py.c */
const char *reason(const char *err, int errnum);
struct fe_engine *engine_of(EngineObject *self, const char *what);

/* fuse_events_py.c */
PyObject *Engine_take(EngineObject *self, PyObject *args);
int events_ready(PyObject *m);

/* fuse_fetch_py.c */
extern PyTypeObject BlockType;
PyObject *Engine_fetch_enable(EngineObject *self, PyObject *capsule);
PyObject *Engine_fetch_engine(EngineObject *self, PyObject *obj);
PyObject *Engine_fetch_post(EngineObject *self, PyObject *args);
PyObject *Engine_read_or_park(EngineObject *self, PyObject *args);
PyObject *Engine_fetch_post_extent(EngineObject *self, PyObject *args);
PyObject *Engine_fetch_post_block(EngineObject *self, PyObject *args);
PyObject *Engine_fetch_landed(EngineObject *self, PyObject *arg);
PyObject *Engine_fetch_peer(EngineObject *self, PyObject *args);
PyObject *Engine_fetch_route(EngineObject *self, PyObject *args);
PyObject *Engine_fetch_unroute(EngineObject *self, PyObject *unused);
PyObject *Engine_fetch_slot(EngineObject *self, PyObject *args);
PyObject *Engine_fetch_staging(EngineObject *self, PyObject *args);
PyObject *Engine_fetch_unpark(EngineObject *self, PyObject *arg);
PyObject *Engine_fetch_keep(EngineObject *self, PyObject *arg);
PyObject *Engine_fetch_tally(EngineObject *self, PyObject *unused);
int fetch_release(EngineObject *self, struct fe_engine *e, int timeout_ms);
PyObject *Engine_fetch_stop(EngineObject *self, PyObject *args);

#pragma GCC visibility pop

#endif
