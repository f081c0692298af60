"""The CSI v1 message classes and gRPC stubs, generated from ``csi.proto`` on first use.

Nothing generated is committed. :func:`load` compiles ``csi.proto`` with
``grpc_tools.protoc`` (the ``csi`` extra: grpcio-tools 1.62, the last release whose
output runs on Debian's protobuf 4.21, which the venv must keep for etcd3) into a cache
directory named by a digest of the .proto and the compiler's version, then imports
from there; later processes import the cached files and need no compiler. A container
image runs ``python -m kspeedfs.csi.stubs`` at build time with ``KSPEEDFS_CSI_STUBS``
set, so the plugin never compiles at run time.

The generated files import each other as the package ``kspeedfs_csi_v1``; that package
is made here from the cache directory (``sys.modules``), not by editing ``sys.path``.

    where the stubs are:  $KSPEEDFS_CSI_STUBS or $XDG_CACHE_HOME/kspeedfs or ~/.cache/kspeedfs
                          └── csi-<digest>/kspeedfs_csi_v1/{__init__,csi_pb2,csi_pb2_grpc}.py
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

PROTO = Path(__file__).with_name("csi.proto")
PACKAGE = "kspeedfs_csi_v1"


def cache_root() -> Path:
    """Where generated stubs are kept (see the module docstring)."""
    if where := os.environ.get("KSPEEDFS_CSI_STUBS"):
        return Path(where)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kspeedfs"


def _compiler_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("grpcio-tools")
    except PackageNotFoundError:
        return "none"


def stubs_dir() -> Path:
    """The directory holding the package for this .proto and compiler."""
    digest = hashlib.sha256(PROTO.read_bytes() + _compiler_version().encode()).hexdigest()[:16]
    return cache_root() / f"csi-{digest}"


def generate(where: Path) -> None:
    """Compile ``csi.proto`` into ``where``; atomic (a temporary directory renamed), so
    processes racing here leave one complete copy."""
    try:
        from grpc_tools import protoc
    except ImportError:
        raise RuntimeError("the CSI stubs are not generated and grpcio-tools is not installed "
                           "(pip install 'kspeedfs[csi]')") from None
    import importlib.resources

    where.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".csi-", dir=where.parent))
    try:
        (tmp / PACKAGE).mkdir()
        shutil.copyfile(PROTO, tmp / PACKAGE / "csi.proto")
        (tmp / PACKAGE / "__init__.py").write_text('"""Generated from kspeedfs/csi/csi.proto."""\n')
        well_known = importlib.resources.files("grpc_tools") / "_proto"
        status = protoc.main(["grpc_tools.protoc", f"-I{tmp}", f"-I{well_known}",
                              f"--python_out={tmp}", f"--grpc_python_out={tmp}",
                              f"{PACKAGE}/csi.proto"])
        if status != 0:
            raise RuntimeError(f"protoc failed on {PROTO} (status {status})")
        try:
            tmp.rename(where)
        except OSError:           # another process got there first: its copy is the same
            if not (where / PACKAGE / "csi_pb2_grpc.py").exists():
                raise
        else:
            log.info("generated the CSI stubs in %s", where)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load() -> tuple[ModuleType, ModuleType]:
    """``(csi_pb2, csi_pb2_grpc)``, generating them first if this cache has none."""
    if PACKAGE not in sys.modules:
        where = stubs_dir()
        if not (where / PACKAGE / "csi_pb2_grpc.py").exists():
            generate(where)
        spec = importlib.util.spec_from_file_location(
            PACKAGE, where / PACKAGE / "__init__.py",
            submodule_search_locations=[str(where / PACKAGE)])
        assert spec is not None and spec.loader is not None
        package = importlib.util.module_from_spec(spec)
        sys.modules[PACKAGE] = package
        spec.loader.exec_module(package)
    return (importlib.import_module(f"{PACKAGE}.csi_pb2"),
            importlib.import_module(f"{PACKAGE}.csi_pb2_grpc"))


if __name__ == "__main__":     # build step of an image: generate now, say where
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    load()
    print(stubs_dir())
