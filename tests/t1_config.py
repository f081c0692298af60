"""Config: one dataclass tree; defaults < file < environment < flags; clear errors."""
from __future__ import annotations

from pathlib import Path

import pytest

from kspeedfs import config
from kspeedfs.errors import ConfigError


def test_defaults_are_valid_and_documented() -> None:
    cfg = config.load(path=None, environ={})
    assert cfg.import_.chunk_size == 4 << 20 and cfg.cache.memory == 1 << 30
    toml = cfg.to_toml()
    assert "[import]" in toml and "chunk_size = \"4MiB\"" in toml
    for line in toml.splitlines():
        if "=" in line:
            assert "#" in line and line.split("#", 1)[1].strip(), f"undocumented: {line}"


def test_override_order(tmp_path: Path) -> None:
    f = tmp_path / "k.toml"
    f.write_text('[cache]\nmemory = "2GiB"\ndisk_dir = "/a"\n[fuse]\nprefetch_chunks = 2\n')
    env = {"KSPEEDFS_CACHE_DISK_DIR": "/b", "KSPEEDFS_FUSE_PREFETCH_CHUNKS": "3"}
    cfg = config.load(f, {"fuse.prefetch_chunks": 5}, environ=env)
    assert cfg.cache.memory == 2 << 30          # file
    assert cfg.cache.disk_dir == "/b"           # environment beats file
    assert cfg.fuse.prefetch_chunks == 5        # flags beat environment
    assert cfg.source_path == str(f)
    # the printed effective config loads back to the same values
    again = tmp_path / "again.toml"
    again.write_text(cfg.to_toml())
    assert config.load(again, environ={}).to_toml().split("\n", 1)[1] == cfg.to_toml().split("\n", 1)[1]


@pytest.mark.parametrize("text, needle", [
    ('[cache]\nmemory = "lots"\n', "cache.memory = 'lots'"),
    ('[cache]\nmemroy = 1\n', "unknown config key 'cache.memroy'"),
    ('[nope]\nx = 1\n', "unknown config key 'nope.x'"),
    ('[import]\nchunk_size = "1000"\n', "import.chunk_size"),
    ('[fuse]\ncongestion_threshold = 100\n', "fuse.congestion_threshold"),
    ('[store]\nbackend = "zookeeper"\n', "store.backend"),
    ('[store]\netcd = ["ftp://x"]\n', "store.etcd"),
    ('not toml [', "config file"),
])
def test_errors_name_key_value_and_source(tmp_path: Path, text: str, needle: str) -> None:
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        config.load(f, environ={})
    assert needle in str(e.value)


def test_missing_explicit_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        config.load(tmp_path / "missing.toml", environ={})


@pytest.mark.parametrize("text, value", [("4MiB", 4 << 20), ("4M", 4 << 20), (" 1 GiB", 1 << 30),
                                         ("0.5KiB", 512), (123, 123), ("7", 7)])
def test_parse_size(text: object, value: int) -> None:
    assert config.parse_size(text) == value


def test_unset_flags_do_not_hide_set_overrides() -> None:
    """A flag the user did not give (None) must not undo ``--set`` (it did, once)."""
    import argparse

    from kspeedfs.cli.options import load_config

    args = argparse.Namespace(set=["cache.disk=64MiB", "cache.disk_dir=/ssd"], store=None, etcd=None,
                              verbose=False, log_level=None, config=None)
    cfg = load_config(args, **{"cache.disk": None, "cache.memory": "2GiB"})
    assert cfg.cache.disk == 64 << 20 and cfg.cache.memory == 2 << 30
