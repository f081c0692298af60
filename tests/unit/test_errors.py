"""One exception convention for both trees (``kspeedfs.errors``, ``rdma.errors``).

Every class carries an int ``errno`` (the same one it had before the two trees shared a
base: ``ERRNO`` below is the table read from the code before that change), the FUSE
boundary answers each with ``FUSEError(err.errno)``, and the CLI wrapper prints one line
for each and exits 1.
"""
from __future__ import annotations

import errno
import inspect
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pyfuse3
import pytest

import kspeedfs.errors as kerrors
import rdma.errors as rerrors
from kspeedfs.cli import app
from kspeedfs.fuse.boundary import fuse_op

# class → errno, as read from both modules before they shared ErrnoError
ERRNO = {
    # kspeedfs.errors
    "KspeedfsError": errno.EIO,
    "ConfigError": errno.EINVAL,
    "MountError": errno.EINVAL,
    "UnsafePath": errno.EPERM,
    "StoreError": errno.EIO,
    "StoreUnavailable": errno.EHOSTUNREACH,
    "DatasetNotFound": errno.ENOENT,
    "VersionConflict": errno.EAGAIN,
    "DatasetInUse": errno.EBUSY,
    "CapacityExceeded": errno.ENOSPC,
    "ManifestCorrupt": errno.EIO,
    "RecordUnverified": errno.EIO,
    "SourceError": errno.ENOENT,
    "ChunkCorrupt": errno.EIO,
    "SourceChanged": errno.EIO,
    "ChunkUnavailable": errno.EIO,
    "SourceTimeout": errno.ETIMEDOUT,       # added since, with its own errno
    "LoadCancelled": errno.EINTR,
    "ReadOnly": errno.EROFS,
    "GrantRefused": errno.EACCES,           # added since: the grant socket (cluster/grant.py)
    "GrantLost": errno.EIO,                 # ... and its reader's side (cluster/granted.py)
    # rdma.errors
    "RdmaError": errno.EIO,
    "RdmaUserError": errno.EINVAL,
    "QPStateError": errno.EINVAL,
    "QPAttrError": errno.EINVAL,
    "PostError": errno.EINVAL,
    "ResourceClosedError": errno.EBADF,
    "ResourceBusyError": errno.EBUSY,
    "NotSupportedError": errno.EOPNOTSUPP,
    "NoDeviceError": errno.ENODEV,
    "ConnectError": errno.ETIMEDOUT,
    "WCError": errno.EIO,
    "PathClosed": errno.EBADF,
    "PathBroken": errno.ECONNRESET,
    "PeerUnreachable": errno.EHOSTUNREACH,
    "HandshakeError": errno.EPROTO,
    "AuthenticationError": errno.EACCES,
}


def _classes() -> list[type[rerrors.ErrnoError]]:
    return [c for mod in (kerrors, rerrors) for c in vars(mod).values()
            if inspect.isclass(c) and issubclass(c, BaseException)
            and c.__module__ == mod.__name__ and c is not rerrors.ErrnoError]


CLASSES = _classes()


def make(cls: type[rerrors.ErrnoError]) -> rerrors.ErrnoError:
    """An instance of ``cls`` made the way its raise sites make one."""
    if cls is rerrors.WCError:
        return cls(SimpleNamespace(status=5, wr_id=7))
    if cls is rerrors.QPStateError:
        return cls("INIT", "RTS")
    if cls is rerrors.QPAttrError:
        return cls("INIT", "RTR", {"dest_qp_num"})
    return cls(f"a {cls.__name__}")


def test_the_table_names_every_class_of_both_trees() -> None:
    assert sorted(c.__name__ for c in CLASSES) == sorted(ERRNO)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_class_carries_its_previous_errno(cls: type[rerrors.ErrnoError]) -> None:
    assert issubclass(cls, rerrors.ErrnoError)
    assert type(cls.errno) is int and cls.errno == ERRNO[cls.__name__]
    e = make(cls)
    assert type(e.errno) is int and e.errno == ERRNO[cls.__name__]


def test_an_instance_may_override_its_class_errno() -> None:
    assert rerrors.RdmaError("x", errno.ENOMEM).errno == errno.ENOMEM
    assert rerrors.PostError("queue full", -errno.ENOMEM).errno == errno.ENOMEM   # abs()
    assert rerrors.HandshakeError("slow", errno=errno.ETIMEDOUT).errno == errno.ETIMEDOUT
    p = rerrors.PeerUnreachable("gone", "node-b", errno.ETIMEDOUT)
    assert (p.errno, p.peer, rerrors.PeerUnreachable.errno) == (
        errno.ETIMEDOUT, "node-b", errno.EHOSTUNREACH)
    k = kerrors.StoreError("etcd said no", errno=errno.EACCES)
    assert (k.errno, str(k), kerrors.StoreError.errno) == (errno.EACCES, "etcd said no", errno.EIO)
    assert kerrors.ReadOnly("w").errno == errno.EROFS          # no override: the class's


def test_rdma_messages_keep_the_pyverbs_form_and_the_cause_is_chained() -> None:
    e = rerrors.PeerUnreachable("no path to b", "b")
    assert (str(e), e.msg) == ("no path to b. Errno: 113, No route to host", "no path to b")
    c = rerrors.from_oserror(OSError(errno.ECONNREFUSED, "refused"), "connect")
    assert type(c) is rerrors.ConnectError and c.errno == errno.ECONNREFUSED
    wc = rerrors.WCError(SimpleNamespace(status=5, wr_id=1))
    try:
        try:
            raise wc
        except rerrors.WCError as inner:
            raise rerrors.PathBroken("path a->b") from inner
    except rerrors.PathBroken as broken:
        assert broken.__cause__ is wc and broken.errno == errno.ECONNRESET


def test_rdma_errors_import_without_kspeedfs() -> None:
    code = ("import sys, rdma.errors; "
            "assert not [m for m in sys.modules if m.startswith('kspeedfs')]")
    subprocess.run([sys.executable, "-c", code], check=True)


class _Ops:
    slow_op = 60.0

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    @fuse_op
    async def read(self, fh: int, off: int, size: int) -> bytes:
        raise self.exc


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
async def test_the_fuse_boundary_answers_each_with_its_errno(cls: type[rerrors.ErrnoError]) -> None:
    with pytest.raises(pyfuse3.FUSEError) as info:
        await _Ops(make(cls)).read(1, 0, 4096)
    assert info.value.errno == ERRNO[cls.__name__]


async def test_the_fuse_boundary_reads_an_instance_errno() -> None:
    with pytest.raises(pyfuse3.FUSEError) as info:
        await _Ops(rerrors.ConnectError("refused", errno.ECONNREFUSED)).read(1, 0, 1)
    assert info.value.errno == errno.ECONNREFUSED
    with pytest.raises(pyfuse3.FUSEError) as info:
        await _Ops(KeyError("a bug")).read(1, 0, 1)
    assert info.value.errno == errno.EIO


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_the_cli_prints_one_line_for_each(cls: type[rerrors.ErrnoError], monkeypatch: Any,
                                         capsys: Any) -> None:
    import kspeedfs.cli.ls as ls

    def run(args: Any) -> int:
        raise make(cls)

    monkeypatch.setattr(ls, "run", run)
    assert app.main(["ls"]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kspeedfs ls: error: "), err
    assert str(make(cls)).split()[0] in lines[0]


def test_the_cli_prints_one_line_for_a_group_of_both_trees() -> None:
    group = ExceptionGroup("nursery", [rerrors.PeerUnreachable("no path", "b"),
                                       kerrors.ChunkUnavailable("chunk 3")])
    message, status = app.describe(group)
    assert status == 1 and "\n" not in message
    assert message.startswith("error: no path. Errno: 113") and message.endswith("(and 1 more)")
