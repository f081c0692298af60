"""Config: one dataclass tree; defaults < file < environment < flags; clear errors."""
from __future__ import annotations

import os
import re
import stat
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


# -- range checks: every key against a real range, naming key, value and source --

@pytest.mark.parametrize("key, value, needle", [
    ("cache.memory", "1PiB", "physical memory"),
    ("cache.memory", "-5", "cache.memory = '-5'"),
    ("cache.memory", "1KiB", "too small"),
    ("cluster.memory", "1PiB", "physical memory"),
    ("cache.disk", "2PiB", "cache.disk"),
    ("store.etcd_timeout", "inf", "finite"),
    ("store.etcd_timeout", "nan", "finite"),
    ("store.etcd_timeout", "-1", "must be > 0"),
    ("fuse.entry_timeout", "1e12", "fuse.entry_timeout"),
    ("store.etcd", "ftp://x", "store.etcd"),
    ("store.etcd", "http://x:70000", "port 1..65535"),
    ("store.etcd", "http://", "store.etcd"),
    ("cluster.port", "70000", "1..65535"),
    ("cluster.port", "-1", "1..65535"),
    ("cluster.port", "0", "1..65535"),
    ("cluster.rpc_port", "7470", "must differ from cluster.port"),
    ("cluster.slot_size", "0", "cluster.slot_size"),
    ("cluster.slot_size", "4097", "cluster.slot_size"),
    ("cluster.nics", "eth0", "not an IP address"),
    ("cluster.nics", "10.0.0.1,10.0.0.1", "twice"),
    ("import.threads", "100000", "import.threads"),
    ("fuse.workers", "0", "fuse.workers"),
    ("cluster.hb_interval", "inf", "finite"),
])
def test_range_checks_name_key_value_and_source(key: str, value: str, needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        config.load(path=None, overrides={key: value}, environ={})
    msg = str(e.value)
    assert needle in msg and key in msg and "command line" in msg and "\n" not in msg


def test_range_error_names_the_environment_and_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cluster.port: 70000 .*\(from environment\)"):
        config.load(path=None, environ={"KSPEEDFS_CLUSTER_PORT": "70000"})
    f = tmp_path / "k.toml"
    f.write_text("[cluster]\nrpc_port = 0\n")
    with pytest.raises(ConfigError, match=f"from {f}"):
        config.load(f, environ={})


def test_nic_that_is_not_local_is_refused_at_start_without_sending() -> None:
    cfg = config.load(path=None, overrides={"cluster.nics": "127.0.0.1"}, environ={})
    cfg.cluster.check_host(node=False)                  # loopback is local
    cfg = config.load(path=None, overrides={"cluster.nics": "198.18.99.99"}, environ={})
    with pytest.raises(ConfigError, match="198.18.99.99 is not an address of this host"):
        cfg.cluster.check_host(node=False)


def test_password_is_redacted() -> None:
    cfg = config.load(path=None, overrides={"store.etcd_password": "hunter2hunter2"}, environ={})
    toml = cfg.to_toml()
    assert "hunter2" not in toml and 'etcd_password = "***"' in toml
    assert 'secret_file = "/etc/kspeedfs/secret"' in toml     # the path is fine to print


# -- the cluster secret ---------------------------------------------------------------------

def _secret_file(tmp_path: Path, data: bytes, mode: int = 0o600) -> config.ClusterConfig:
    f = tmp_path / "secret"
    f.write_bytes(data)
    f.chmod(mode)
    return config.ClusterConfig(secret_file=str(f))


@pytest.mark.parametrize("data", [
    os.urandom(32).hex().encode(),                  # what secret generate writes
    os.urandom(32).hex().encode() + b"\n",          # stripped
    os.urandom(16).hex().encode(),                  # 128 bits exactly
    b"\x01" + os.urandom(30) + b"\x02",             # raw binary (no whitespace to strip)
    b"Tr0ub4dor&3-xyzABCDEF",                       # every class, 21 characters
])
def test_good_secrets_are_accepted(tmp_path: Path, data: bytes) -> None:
    assert _secret_file(tmp_path, data).secret() == data.strip()


@pytest.mark.parametrize("data, needle", [
    (b"short", "16..4096"),
    (b"passwordpassword", "guessable"),
    (b"correcthorsebatterystaple", "guessable"),     # lowercase words: 25 x 4.7 bits
    (b"0123456789" * 4, "guessable"),               # a repeated pattern counts once
    (b"a" * 40 + b"b", "guessable"),                # two distinct bytes
    (os.urandom(8).hex().encode(), "guessable"),    # 64 bits of hex
    (b"x" * 5000, "16..4096"),
])
def test_weak_secrets_are_refused(tmp_path: Path, data: bytes, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        _secret_file(tmp_path, data).secret()


def test_secret_readable_by_others_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="chmod 600"):
        _secret_file(tmp_path, os.urandom(32).hex().encode(), 0o644).secret()
    with pytest.raises(ConfigError, match="No such file"):
        config.ClusterConfig(secret_file=str(tmp_path / "missing")).secret()


def test_secret_generate(tmp_path: Path) -> None:
    from kspeedfs.cli.secret import generate

    f = tmp_path / "secret"
    generate(str(f))
    assert stat.S_IMODE(f.stat().st_mode) == 0o600
    text = f.read_text()
    assert text.endswith("\n") and len(bytes.fromhex(text.strip())) == 32
    assert config.ClusterConfig(secret_file=str(f)).secret() == text.strip().encode()
    with pytest.raises(ConfigError, match="exists"):
        generate(str(f))                             # never overwrites by accident
    assert f.read_text() == text
    generate(str(f), force=True)
    assert f.read_text() != text and stat.S_IMODE(f.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["secret"]     # no temporary left behind


def test_manifest_with_chunk_size_0_is_refused_at_load() -> None:
    import zlib

    from kspeedfs.errors import ManifestCorrupt
    from kspeedfs.manifest.index import ManifestIndex
    from kspeedfs.manifest.model import HEADER, MAGIC

    for chunk, block in ((0, 0), (4 << 20, 0), (4 << 20, 8 << 20)):
        raw = HEADER.pack(MAGIC, 2, chunk, 1, 0, 0, 0, 0, 1, block) + b"\0" * 256
        with pytest.raises(ManifestCorrupt, match="chunk_size|block_size"):
            ManifestIndex.from_blob(zlib.compress(raw))


def test_cluster_heartbeat_is_built_from_the_hb_keys() -> None:
    cfg = config.load(path=None, environ={"KSPEEDFS_CLUSTER_HB_MISS": "7",
                                          "KSPEEDFS_CLUSTER_PEER_TIMEOUT": "1.5"})
    hb = cfg.cluster.heartbeat()
    assert (hb.interval, hb.miss_threshold, hb.suspect_after) == (0.010, 7, 2)
    assert (hb.unreachable_grace, hb.idle_interval, hb.quiet_interval) == (1.5, 0.100, 1.0)


@pytest.mark.parametrize("value", ["0.05", "nan", "601"])
def test_a_quiet_heartbeat_interval_below_the_idle_one_or_absurd_is_refused(value: str) -> None:
    with pytest.raises(config.ConfigError, match="cluster.hb_quiet_interval"):
        config.load(path=None, environ={"KSPEEDFS_CLUSTER_HB_QUIET_INTERVAL": value})


def test_host_readers_from_a_file_the_environment_and_back(tmp_path: Path) -> None:
    """``cluster.host_readers`` as a TOML table, as the environment's string, and as
    ``kspeedfs config`` prints it (read back the same)."""
    f = tmp_path / "k.toml"
    f.write_text('[cluster.host_readers]\nimgs = ["uid:1000", "group:ml"]\ntext = []\n')
    cfg = config.load(f, environ={"KSPEEDFS_CLUSTER_GRANT_SOCKET": "/run/x/{node}.grant"})
    assert cfg.cluster.host_readers == {"imgs": ["uid:1000", "group:ml"], "text": []}
    assert cfg.cluster.grant_socket == "/run/x/{node}.grant"
    again = tmp_path / "again.toml"
    again.write_text(cfg.to_toml())
    assert config.load(again, environ={}).cluster.host_readers == cfg.cluster.host_readers
    env = config.load(path=None, environ={"KSPEEDFS_CLUSTER_HOST_READERS": "a=*;b=user:alice,gid:7"})
    assert env.cluster.host_readers == {"a": ["*"], "b": ["user:alice", "gid:7"]}


@pytest.mark.parametrize("key,value,needle", [
    ("cluster.host_readers", "imgs=uid:alice", "'uid:alice' (for imgs) is not 'uid:N'"),
    ("cluster.host_readers", "imgs=root", "'root' (for imgs)"),
    ("cluster.host_readers", "nonsense", "expected 'dataset=principal"),
    ("cluster.segment_bytes", "6MiB", "multiple of cluster.slot_size"),
    ("cluster.grant_socket", "run/x.grant", "absolute path"),
])
def test_grant_keys_are_checked(key: str, value: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(needle)) as e:
        config.load(path=None, overrides={key: value}, environ={})
    assert "\n" not in str(e.value)
