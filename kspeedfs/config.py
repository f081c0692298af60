"""kspeedfs configuration: one dataclass tree, loaded in one documented order.

Override order (later wins)::

    built-in defaults  <  config file  <  KSPEEDFS_<SECTION>_<KEY> environment  <  command-line flags

The config file is ``--config PATH`` if given, else ``$KSPEEDFS_CONFIG``, else
``/etc/kspeedfs/kspeedfs.toml`` if it exists. Every key below is a field with its
default and a comment; ``kspeedfs config`` prints the effective configuration as TOML.
Errors name the key, the value and where it came from.

Sizes accept integers (bytes) or strings with a binary suffix: ``"512MiB"``, ``"4M"``,
``"1GiB"``. Durations are seconds (float).
"""
from __future__ import annotations

import dataclasses
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .errors import ConfigError

DEFAULT_CONFIG_PATH = Path("/etc/kspeedfs/kspeedfs.toml")

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.I)


def parse_size(value: object) -> int:
    """``4194304``, ``"4MiB"``, ``"4M"``, ``"0.5GiB"`` → bytes (binary units)."""
    if isinstance(value, bool):
        raise ValueError("a size, not a boolean")
    if isinstance(value, int):
        return value
    m = _SIZE.match(str(value))
    if not m:
        raise ValueError("expected bytes or a size like '512MiB'")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_size(n: int) -> str:
    for unit, mult in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{unit}"
    return str(n)


def _size(default: str, doc: str) -> Any:
    return field(default=parse_size(default), metadata={"size": True, "doc": doc})


def _opt(default: Any, doc: str) -> Any:
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


@dataclass
class StoreConfig:
    """Where dataset manifests live (``manifest/store/``)."""

    backend: str = _opt("embedded", "'embedded' (local directory, no server) or 'etcd'")
    path: str = _opt("/var/lib/kspeedfs/store", "embedded store directory")
    etcd: list[str] = _opt(["http://127.0.0.1:2379"], "etcd endpoints (http[s]://host:port)")
    etcd_prefix: str = _opt("/kspeedfs/", "key prefix of everything kspeedfs keeps in etcd")
    etcd_user: str = _opt("", "etcd user name (auth enabled when set)")
    etcd_password: str = _opt("", "etcd password")
    etcd_ca_cert: str = _opt("", "CA bundle for etcd TLS (https endpoints)")
    etcd_cert: str = _opt("", "client certificate for etcd mutual TLS")
    etcd_key: str = _opt("", "client key for etcd mutual TLS")
    etcd_timeout: float = _opt(5.0, "seconds before an etcd request counts as unavailable")

    def validate(self) -> None:
        _choice("store.backend", self.backend, ("embedded", "etcd"))
        if self.backend == "etcd" and not self.etcd:
            raise ConfigError("store.etcd: at least one endpoint is needed for backend 'etcd'")
        for ep in self.etcd:
            if not re.match(r"^https?://[^/:]+(:\d+)?/?$", ep):
                raise ConfigError(f"store.etcd: {ep!r} is not http[s]://host[:port]")
        _positive("store.etcd_timeout", self.etcd_timeout)


@dataclass
class ImportConfig:
    """How ``kspeedfs import`` lays data out (``manifest/importer.py``)."""

    chunk_size: int = _size("4MiB", "fixed chunk size; files smaller than this are packed")
    block_size: int = _size("128KiB", "unit a random read loads and verifies (manifest/model.py)")
    threads: int = _opt(0, "reader/hasher threads; 0 = 2 x CPUs (hashing releases the GIL)")

    def validate(self) -> None:
        if not (64 << 10) <= self.chunk_size <= (256 << 20) or self.chunk_size % 4096:
            raise ConfigError(
                f"import.chunk_size: {self.chunk_size} must be a multiple of 4 KiB in 64 KiB..256 MiB"
            )
        if not 4096 <= self.block_size <= self.chunk_size or self.block_size % 4096:
            raise ConfigError(f"import.block_size: {self.block_size} must be a multiple of 4 KiB "
                              f"in 4 KiB..import.chunk_size ({self.chunk_size})")
        if self.threads < 0:
            raise ConfigError(f"import.threads: {self.threads} must be >= 0")


@dataclass
class CacheConfig:
    """The local chunk cache (``cache/``): memory, then an optional disk tier."""

    memory: int = _size("1GiB", "memory tier capacity (verified chunks, LRU)")
    disk_dir: str = _opt("", "disk tier directory; empty = no disk tier")
    disk: int = _size("0", "disk tier capacity; 0 = no disk tier")

    def validate(self) -> None:
        if self.memory < 2 * (4 << 20):
            raise ConfigError(f"cache.memory: {self.memory} is too small (at least 8 MiB)")
        if self.disk and not self.disk_dir:
            raise ConfigError("cache.disk is set but cache.disk_dir is empty")


@dataclass
class FuseConfig:
    """The mount (``fuse/``, ``daemon.py``) and the kernel knobs set after mounting."""

    allow_other: bool = _opt(False, "let other users see the mount (needs user_allow_other for non-root)")
    entry_timeout: float = _opt(86400.0, "kernel dentry cache lifetime, s (the snapshot is immutable)")
    attr_timeout: float = _opt(86400.0, "kernel attribute cache lifetime, s")
    prefetch_chunks: int = _opt(4, "chunks fetched ahead of a sequential reader")
    blksize: int = _size("0", "st_blksize reported for files; 0 = the manifest's block size "
                               "(import.block_size; the chunk size for a manifest without blocks). "
                               "Python's open() buffers st_blksize bytes per read: with the chunk "
                               "size a 4 KiB record read loaded a whole chunk (sweep-blksize)")
    xattrs: bool = _opt(False, "serve user.kspeedfs.* xattrs (stats, checksums); off: the kernel "
                               "stops asking, and ls -l sends no 2 GETXATTRs per entry")
    push_pages: bool = _opt(False, "store prefetched chunks in the kernel page cache (FUSE_NOTIFY_STORE) "
                                  "so sequential readers skip the READ round trip")
    max_background: int = _opt(64, "FUSE max_background, set via sysfs after mount (kernel default 12)")
    congestion_threshold: int = _opt(48, "FUSE congestion_threshold via sysfs (default 3/4 of max_background)")
    read_ahead_kb: int = _opt(4096, "bdi read_ahead_kb via sysfs (kernel default 128)")
    workers: int = _opt(16, "threads for blocking source/disk I/O")

    def validate(self) -> None:
        if self.blksize and (self.blksize < 512 or self.blksize & (self.blksize - 1)):
            raise ConfigError(f"fuse.blksize: {self.blksize} must be 0 or a power of two >= 512")
        _positive("fuse.entry_timeout", self.entry_timeout)
        _positive("fuse.attr_timeout", self.attr_timeout)
        if self.prefetch_chunks < 0:
            raise ConfigError(f"fuse.prefetch_chunks: {self.prefetch_chunks} must be >= 0")
        if not 1 <= self.max_background <= 65535:
            raise ConfigError(f"fuse.max_background: {self.max_background} must be in 1..65535")
        if not 1 <= self.congestion_threshold <= self.max_background:
            raise ConfigError(
                f"fuse.congestion_threshold: {self.congestion_threshold} must be in 1..max_background"
            )
        if not 0 <= self.read_ahead_kb <= 1 << 20:
            raise ConfigError(f"fuse.read_ahead_kb: {self.read_ahead_kb} must be in 0..1048576")
        if self.workers < 1:
            raise ConfigError(f"fuse.workers: {self.workers} must be >= 1")


@dataclass
class ClusterConfig:
    """The cluster (``cluster/``): node daemons pooling memory, mounts reading peers.

    A mount uses peers when the store is etcd and ``peers`` is true; ``kspeedfs node``
    always needs etcd. Every process of one cluster must share ``secret``."""

    peers: bool = _opt(True, "with the etcd store, read chunks from peers before the source")
    secret_file: str = _opt("/etc/kspeedfs/secret", "file holding the cluster's shared secret")
    replicas: int = _opt(2, "R: owners per chunk (placement.py)")
    nics: list[str] = _opt([], "local NIC addresses to use; empty = every RDMA device but loopback")
    port: int = _opt(7470, "vRDMA endpoint (control) port of a node")
    rpc_port: int = _opt(7471, "node control RPC port (load-on-demand, status)")
    provider: str = _opt("", "RDMA provider: 'soft', 'verbs' or '' (verbs if devices exist)")
    memory: int = _size("1GiB", "node: memory arena registered for RDMA (chunk slots)")
    slot_size: int = _size("4MiB", "node: arena slot size = the largest chunk size served")
    lease_ttl: int = _opt(5, "node: membership lease TTL, s (a dead node leaves after this)")
    preload_workers: int = _opt(4, "node: chunks loaded concurrently by preload/re-replication")
    hb_interval: float = _opt(0.010, "vRDMA heartbeat interval per path, s")
    hb_miss: int = _opt(5, "heartbeats missed before a path is DOWN (detection ~ miss x interval)")
    hb_idle_interval: float = _opt(0.100, "heartbeat interval of a peer connection with no READ "
                                   "for 1 s, s (the next READ restores hb_interval at once)")
    peer_timeout: float = _opt(0.5, "all paths to a peer dead this long -> try the next replica, s")

    def validate(self) -> None:
        if not 1 <= self.replicas <= 16:
            raise ConfigError(f"cluster.replicas: {self.replicas} must be in 1..16")
        if self.memory < self.slot_size * 2:
            raise ConfigError(f"cluster.memory: {self.memory} must hold at least two slots")
        if self.slot_size % 4096:
            raise ConfigError(f"cluster.slot_size: {self.slot_size} must be a multiple of 4 KiB")
        _choice("cluster.provider", self.provider, ("", "soft", "verbs"))
        if self.lease_ttl < 1:
            raise ConfigError(f"cluster.lease_ttl: {self.lease_ttl} must be >= 1")
        _positive("cluster.hb_interval", self.hb_interval)
        if self.hb_idle_interval < self.hb_interval:
            raise ConfigError(f"cluster.hb_idle_interval: {self.hb_idle_interval} must be >= "
                              f"cluster.hb_interval ({self.hb_interval})")
        _positive("cluster.peer_timeout", self.peer_timeout)
        if self.hb_miss < 2:
            raise ConfigError(f"cluster.hb_miss: {self.hb_miss} must be >= 2")

    def secret(self) -> bytes:
        try:
            data = open(self.secret_file, "rb").read().strip()
        except OSError as e:
            raise ConfigError(f"cluster.secret_file {self.secret_file}: {e.strerror} "
                              "(every node and mount of a cluster needs the same secret)") from None
        if len(data) < 16:
            raise ConfigError(f"cluster.secret_file {self.secret_file}: the secret is shorter than 16 bytes")
        return data


@dataclass
class LogConfig:
    """Where the daemon logs (``log.py``)."""

    dir: str = _opt("/var/log/kspeedfs", "daemon log directory (one file per mount)")
    level: str = _opt("INFO", "DEBUG, INFO, WARNING or ERROR")
    slow_op: float = _opt(1.0, "log a warning for FUSE operations slower than this, s")

    def validate(self) -> None:
        _choice("log.level", self.level.upper(), ("DEBUG", "INFO", "WARNING", "ERROR"))


@dataclass
class Config:
    store: StoreConfig = field(default_factory=StoreConfig)
    import_: ImportConfig = field(default_factory=ImportConfig, metadata={"toml": "import"})
    cache: CacheConfig = field(default_factory=CacheConfig)
    fuse: FuseConfig = field(default_factory=FuseConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    log: LogConfig = field(default_factory=LogConfig)
    source_path: str = field(default="", metadata={"skip": True})  # file the config came from

    def validate(self) -> "Config":
        for section in _sections(self):
            getattr(self, section.name).validate()
        return self

    def to_toml(self) -> str:
        lines = [f"# effective kspeedfs configuration (file: {self.source_path or 'none'})"]
        for section in _sections(self):
            obj = getattr(self, section.name)
            lines.append(f"\n[{_toml_name(section)}]")
            for f in dataclasses.fields(obj):
                v = getattr(obj, f.name)
                shown = format_size(v) if f.metadata.get("size") else v
                lines.append(f"{f.name} = {_toml_value(shown)}  # {f.metadata.get('doc', '')}")
        return "\n".join(lines) + "\n"


def _sections(cfg: Config) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(cfg) if not f.metadata.get("skip")]


def _toml_name(f: dataclasses.Field[Any]) -> str:
    return f.metadata.get("toml", f.name)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(allowed)}")


def _positive(key: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{key}: {value} must be > 0")


def _coerce(key: str, f: dataclasses.Field[Any], value: Any, source: str) -> Any:
    typ = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    try:
        if f.metadata.get("size"):
            return parse_size(value)
        if typ == "bool":
            if isinstance(value, bool):
                return value
            s = str(value).lower()
            if s in ("1", "true", "yes", "on"):
                return True
            if s in ("0", "false", "no", "off"):
                return False
            raise ValueError("expected true or false")
        if typ == "int":
            if isinstance(value, bool):
                raise ValueError("expected an integer")
            return int(value)
        if typ == "float":
            return float(value)
        if typ.startswith("list"):
            if isinstance(value, str):
                return [x.strip() for x in value.split(",") if x.strip()]
            if not isinstance(value, list):
                raise ValueError("expected a list")
            return [str(x) for x in value]
        if not isinstance(value, (str, int, float)):
            raise ValueError("expected a string")
        return str(value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{key} = {value!r} (from {source}): {e}") from None


def apply(cfg: Config, values: Mapping[str, Any], source: str) -> None:
    """Apply ``{"section.key": value}`` (or nested ``{"section": {"key": v}}``) onto cfg."""
    by_toml = {_toml_name(f): f for f in _sections(cfg)}
    flat: dict[str, Any] = {}
    for k, v in values.items():
        if isinstance(v, dict):
            for kk, vv in v.items():
                flat[f"{k}.{kk}"] = vv
        else:
            flat[k] = v
    for key, value in flat.items():
        section_name, _, name = key.partition(".")
        section_field = by_toml.get(section_name)
        if section_field is None or not name:
            raise ConfigError(f"unknown config key {key!r} (from {source})")
        section = getattr(cfg, section_field.name)
        fields = {f.name: f for f in dataclasses.fields(section)}
        if name not in fields:
            raise ConfigError(
                f"unknown config key {key!r} (from {source}); [{section_name}] has: "
                + ", ".join(fields)
            )
        setattr(section, name, _coerce(key, fields[name], value, source))


def load(
    path: str | os.PathLike[str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Build the effective config: defaults < file < environment < ``overrides`` (flags)."""
    environ = os.environ if environ is None else environ
    cfg = Config()
    explicit = path or environ.get("KSPEEDFS_CONFIG")
    file = Path(explicit) if explicit else DEFAULT_CONFIG_PATH
    if file.exists():
        try:
            data = tomllib.loads(file.read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"config file {file}: {e}") from None
        apply(cfg, data, str(file))
        cfg.source_path = str(file)
    elif explicit:
        raise ConfigError(f"config file {file} does not exist")
    env: dict[str, Any] = {}
    sections = {_toml_name(f).upper(): _toml_name(f) for f in _sections(cfg)}
    for k, v in environ.items():
        if not k.startswith("KSPEEDFS_") or k == "KSPEEDFS_CONFIG":
            continue
        rest = k[len("KSPEEDFS_"):]
        for upper, section in sections.items():
            if rest.startswith(upper + "_"):
                env[f"{section}.{rest[len(upper) + 1:].lower()}"] = v
    apply(cfg, env, "environment")
    if overrides:
        apply(cfg, {k: v for k, v in overrides.items() if v is not None}, "command line")
    return cfg.validate()
