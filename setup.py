"""Build the C hot paths in native/ as extension modules of the packages that use them.

Each native module is its engine in native/ (C, no Python: a public header, and a private
one, ``<name>_i.h``, for what crosses its files) plus its CPython binding (``<name>_py.c``);
the Python package that owns the concept imports it (e.g. ``rdma.providers.soft`` imports
``rdma._soft_engine``).
After editing a .c file in a dev checkout: ``python setup.py build_ext --inplace``.
"""
from setuptools import Extension, setup

CFLAGS = ["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-std=gnu11"]

# the soft RDMA engine's C files (soft_engine_i.h maps them), without its binding
SOFT_ENGINE_SOURCES = ["native/soft_engine.c", "native/soft_wire.c", "native/soft_transport.c",
                       "native/soft_qp.c", "native/soft_requester.c", "native/soft_responder.c",
                       "native/soft_cq.c", "native/soft_mr.c"]
# the native FUSE engine's C files (fuse_engine_i.h maps them), without its binding
FUSE_ENGINE_SOURCES = ["native/fuse_engine.c", "native/fuse_mount.c", "native/fuse_reply.c",
                       "native/fuse_ops.c", "native/fuse_read.c", "native/fuse_queue.c",
                       "native/fuse_uring.c", "native/fuse_threads.c", "native/fuse_tier.c",
                       "native/fuse_fetch.c", "native/fetch_read.c", "native/fuse_xxh.c",
                       "native/fuse_xxh_avx2.c"]

ext_modules: list[Extension] = [
    # rdma/ soft provider: socket I/O into registered memory, eventfd completions, no GIL
    Extension("rdma._soft_engine", ["native/soft_engine_py.c", *SOFT_ENGINE_SOURCES],
              depends=["native/soft_engine.h", "native/soft_engine_i.h", "native/py_errno.h",
                       "native/tuning.h"],
              include_dirs=["native"],
              extra_compile_args=CFLAGS),
    # kspeedfs/fuse native engine: /dev/fuse request threads and io_uring queues (liburing,
    # Debian 12's liburing-dev 2.3), metadata and tier hits in C
    # ... and the native chunk fetch (fuse_fetch.c: peers' chunks posted, verified with
    # xxh3 from Debian's libxxhash-dev header, inline, and answered in C)
    Extension("kspeedfs.fuse._engine", ["native/fuse_engine_py.c", "native/fuse_events_py.c",
                                        "native/fuse_fetch_py.c", *FUSE_ENGINE_SOURCES],
              depends=["native/fuse_engine.h", "native/fuse_engine_i.h", "native/fuse_engine_py.h",
                       "native/fuse_tier.h", "native/fuse_uring_abi.h", "native/fuse_fetch.h",
                       "native/fuse_xxh.h", "native/soft_engine.h", "native/py_errno.h",
                       "native/fetch_paths_py.h",
                       "native/tuning.h", "native/manifest_pager.h"],
              include_dirs=["native"], libraries=["uring"], extra_compile_args=CFLAGS),
    # kspeedfs/cluster: the library's native fetch, a small file's extent READ from a peer
    # by the reading thread itself (peer_wait.c; its READ and check shared with the mount's
    # fetch: fetch_read.c)
    Extension("kspeedfs.cluster._peerwait", ["native/peer_wait_py.c", "native/peer_wait.c",
                                            "native/fetch_read.c", "native/fuse_xxh.c",
                                            "native/fuse_xxh_avx2.c"],
              depends=["native/peer_wait.h", "native/fetch_read.h", "native/fuse_fetch.h",
                       "native/fuse_xxh.h", "native/soft_engine.h", "native/py_errno.h",
                       "native/fetch_paths_py.h"],
              include_dirs=["native"], extra_compile_args=CFLAGS),
    # kspeedfs/manifest paged manifests: the page map, a blob's pages filled on first touch
    # by userfaultfd handler threads (no GIL), verified with OpenSSL's SHA-256, inflated by
    # libdeflate (Debian's libdeflate-dev; ~2x zlib's inflate, docs/design.md "The page map")
    Extension("kspeedfs.manifest._pager", ["native/manifest_pager_py.c", "native/manifest_pager.c"],
              depends=["native/manifest_pager.h", "native/py_errno.h"],
              include_dirs=["native"], libraries=["crypto", "deflate", "z"],
              extra_compile_args=CFLAGS),
]

setup(ext_modules=ext_modules)
