"""Secret config keys (``store.etcd_password``): read from a root-only file
(``store.etcd_password_file``), a warning when one arrives on the command line, and never
in the argv of a process kspeedfs starts again (the supervisor's re-spawned daemons get
them in their environment: ``config.secret_environment``, ``cli/mount.py``)."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from kspeedfs import config
from kspeedfs.cli.mount import _remount_argv
from kspeedfs.errors import ConfigError

PASSWORD = "c0rrect-h0rse-battery"


def _file(tmp_path: Path, data: str, mode: int = 0o600) -> Path:
    f = tmp_path / "etcd-password"
    f.write_text(data)
    f.chmod(mode)
    return f


def _from_file(path: Path) -> config.StoreConfig:
    return config.load(None, {"store.etcd_password_file": str(path)}, environ={}).store


def test_password_file_is_read_without_its_trailing_newline(tmp_path: Path) -> None:
    assert _from_file(_file(tmp_path, PASSWORD + "\n")).password() == PASSWORD
    assert _from_file(_file(tmp_path, " spaced pass ")).password() == " spaced pass "


def test_password_without_a_file_is_the_value(tmp_path: Path) -> None:
    cfg = config.load(None, {}, environ={"KSPEEDFS_STORE_ETCD_PASSWORD": PASSWORD})
    assert cfg.store.password() == PASSWORD


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644])
def test_password_file_others_may_read_is_refused(tmp_path: Path, mode: int) -> None:
    store = _from_file(_file(tmp_path, PASSWORD, mode))
    with pytest.raises(ConfigError, match=r"store.etcd_password_file .*chmod 600") as e:
        store.password()
    assert PASSWORD not in str(e.value) and "\n" not in str(e.value)


def test_password_file_missing_or_empty_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="store.etcd_password_file .*No such file"):
        _from_file(tmp_path / "missing").password()
    with pytest.raises(ConfigError, match="empty"):
        _from_file(_file(tmp_path, "\n")).password()


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_password_file_of_another_user_is_refused(tmp_path: Path) -> None:
    f = _file(tmp_path, PASSWORD)
    os.chown(f, 65534, 65534)                            # nobody: could read or replace it
    with pytest.raises(ConfigError, match="owned by uid 65534"):
        _from_file(f).password()


def test_password_and_password_file_together_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not both"):
        config.load(None, {"store.etcd_password_file": str(_file(tmp_path, PASSWORD))},
                    environ={"KSPEEDFS_STORE_ETCD_PASSWORD": PASSWORD})


def test_a_secret_on_the_command_line_is_warned_about_once(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kspeedfs.config"):
        config.load(None, {"store.etcd_password": PASSWORD}, environ={})
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "store.etcd_password_file" in lines[0] and "ps" in lines[0]
    assert PASSWORD not in lines[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kspeedfs.config"):
        config.load(None, {"store.etcd_user": "root"},
                    environ={"KSPEEDFS_STORE_ETCD_PASSWORD": PASSWORD})
    assert caplog.records == []                          # the environment is not the argv


def test_only_command_line_secrets_go_to_the_environment_of_a_respawn() -> None:
    cfg = config.load(None, {"store.etcd_password": PASSWORD, "store.etcd_user": "root"},
                      environ={})
    assert config.secret_environment(cfg) == {"KSPEEDFS_STORE_ETCD_PASSWORD": PASSWORD}
    again = config.load(None, {}, environ=config.secret_environment(cfg))
    assert again.store.password() == PASSWORD                    # what the daemon reads back
    assert config.secret_environment(again) == {}                # inherited, not re-added


def test_the_remount_argv_carries_no_secret_in_any_spelling() -> None:
    argv = ["mount", "ds", "/mnt/ds", "--set", f"store.etcd_password={PASSWORD}",
            f"--set=store.etcd_password={PASSWORD}", "--se", f"store.etcd_password={PASSWORD}",
            "-o", f"ro,store.etcd_password={PASSWORD},allow_other",
            f"-ostore.etcd_password={PASSWORD}", "-o", f" store.etcd_password={PASSWORD}",
            "--set", "store.etcd_password_file=/etc/kspeedfs/etcd-password",
            "--set", "fuse.xattrs=true", "--resume", "/run/x.resume", "--manifest-fd", "7",
            "--upgrade"]
    out = _remount_argv(argv)
    assert not any(PASSWORD in a for a in out), out
    assert out == ("mount", "ds", "/mnt/ds", "-o", "ro,allow_other",
                   "--set", "store.etcd_password_file=/etc/kspeedfs/etcd-password",
                   "--set", "fuse.xattrs=true")


def test_config_prints_the_password_file_and_hides_the_password(tmp_path: Path) -> None:
    f = _file(tmp_path, PASSWORD)
    toml = config.load(None, {"store.etcd_password_file": str(f)}, environ={}).to_toml()
    assert f'etcd_password_file = "{f}"' in toml and PASSWORD not in toml
    assert "prefer etcd_password_file" in toml                   # the field's doc says so
