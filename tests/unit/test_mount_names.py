"""What is named after a mount point (``mountpoint.name_for``): its handover socket
(fuse/upgrade.py ``socket_path``), always short enough to bind, with the supervisor's
``.resume`` suffix too, and its log file (log.py ``log_path``), always a valid file name;
one name per mount point. And a handover socket that cannot be bound, and an upgrade
that finds an older daemon under the name it listened at."""
from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import trio

from kspeedfs.errors import MountError
from kspeedfs.fuse import upgrade
from kspeedfs.fuse.upgrade import RESUME_SUFFIX, RUN_DIR, SUN_PATH_MAX, HandoverServer, socket_path
from kspeedfs.log import log_path
from kspeedfs.mountpoint import NAME_MAX


def test_a_short_mount_point_names_its_socket_readably() -> None:
    assert socket_path("/mnt/imagenet") == f"{RUN_DIR}/mnt_imagenet.sock"


def test_a_long_mount_point_gets_a_socket_name_that_binds(tmp_path: Path) -> None:
    long = "/tmp/pytest-of-root/pytest-92/test_quick_imagenet_reports_ra0/work/mnt/kspeedfs-warm"
    for i, mp in enumerate((long, long + "2", "/" + "d/" * 200 + "mnt")):
        path = socket_path(mp) + RESUME_SUFFIX
        assert len(path.encode()) <= SUN_PATH_MAX, path
        # an address as long binds (RUN_DIR needs root: bind one in tmp_path)
        probe = tmp_path / f"{i}".ljust(len(path) - len(str(tmp_path)) - 1, "x")
        assert len(str(probe)) == len(path)
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.bind(str(probe))
    assert socket_path(long).startswith(f"{RUN_DIR}/tmp_pytest-of-root")
    assert socket_path(long) != socket_path(long + "2")
    assert socket_path(long) == socket_path(long + "/")      # one mount point, one name


def test_a_handover_socket_that_cannot_be_bound_leaves_the_mount_serving(
        tmp_path: Path, caplog) -> None:
    """``HandoverServer.run`` reports the mount as started and returns with a warning: the
    mount goes on, only its upgrades in place are lost."""
    async def stop() -> None:
        raise AssertionError("nothing to stop")

    server = HandoverServer(str(tmp_path / "mnt"), "ds", 1, -1, dict, stop)
    server.path = str(tmp_path / "no-such-dir" / "mnt.sock")

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run)       # returns: started, then the task ends

    trio.run(main)
    assert "cannot be upgraded in place" in caplog.text


def test_a_mount_point_longer_than_a_file_name_gets_a_log_it_can_open(tmp_path: Path) -> None:
    deep = tmp_path / ("b" * 100) / ("c" * 100) / ("d" * 100)
    path = log_path(str(tmp_path), "d" * 128, str(deep))     # the longest dataset name
    assert len(os.path.basename(path)) <= NAME_MAX
    open(path, "w").close()
    assert log_path(str(tmp_path), "ds", str(deep)) != log_path(str(tmp_path), "ds", str(deep) + "e")
    assert log_path("/var/log/kspeedfs", "ds", "/mnt/x") == "/var/log/kspeedfs/mount-ds-mnt_x.log"


@pytest.mark.parametrize("a, b", [("/d/a_b", "/d/a/b"), ("/", "/root"), ("/mnt/x y", "/mnt/x_y"),
                                  ("/mnt/x-y", "/mnt/x_y")])
def test_two_mount_points_never_share_a_socket_or_a_log(a: str, b: str) -> None:
    """The plain name (``/`` made ``_``) was not one-to-one: ``/d/a_b`` and ``/d/a/b``
    shared a handover socket, and the second mount's daemon unlinked the first's."""
    assert socket_path(a) != socket_path(b)
    assert log_path("/var/log/kspeedfs", "ds", a) != log_path("/var/log/kspeedfs", "ds", b)


def test_an_upgrade_finds_an_older_daemon_at_the_name_it_shared(tmp_path: Path,
                                                                 monkeypatch) -> None:
    """A daemon from before the names were one-to-one listens at the shared name: the new
    daemon asks there too (this one refuses: another dataset, so the old one serves on)."""
    monkeypatch.setattr(upgrade, "RUN_DIR", str(tmp_path))
    mp = "/d/a_b"
    assert socket_path(mp) != socket_path(mp, shared=True) == f"{tmp_path}/d_a_b.sock"

    async def stop() -> None:
        raise AssertionError("nothing to stop")

    old = HandoverServer(mp, "ds", 1, -1, dict, stop)
    old.path = socket_path(mp, shared=True)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(old.run)
            with pytest.raises(MountError, match="this mount serves ds@1, not other@2"):
                await upgrade.take_over(mp, "other", 2, lambda *a: None)
            nursery.cancel_scope.cancel()

    trio.run(main)
    with pytest.raises(MountError, match=f"no kspeedfs daemon .*{socket_path(mp)}"):
        trio.run(upgrade.take_over, mp, "ds", 1, lambda *a: None)
