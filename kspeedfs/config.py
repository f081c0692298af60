"""kspeedfs configuration: one dataclass tree, loaded in one documented order.

Override order (later wins)::

    built-in defaults  <  config file  <  KSPEEDFS_<SECTION>_<KEY> environment  <  command-line flags

The config file is ``--config PATH`` if given, else ``$KSPEEDFS_CONFIG``, else
``/etc/kspeedfs/kspeedfs.toml`` if it exists. Every key below is a field with its
default and a comment; ``kspeedfs config`` prints the effective configuration as TOML.
Errors name the key, the value and where it came from.

Sizes accept integers (bytes) or strings with a binary suffix: ``"512MiB"``, ``"4M"``,
``"1GiB"``. Durations are seconds (float), finite (``inf``/``nan`` are refused).

Validation (``validate()`` per section) checks every key against a real range: memory
sizes against this host's physical RAM, ports in 1..65535 (the node's two distinct),
etcd URLs http/https only, NIC entries IP addresses. What only the host that runs a
process can check (NIC addresses are local, memory is free now) is
:meth:`ClusterConfig.check_host` / :meth:`CacheConfig.check_host`, called by
``kspeedfs node`` and ``kspeedfs mount`` at start. The cluster secret and its rules:
:meth:`ClusterConfig.secret` (``kspeedfs secret generate`` writes a good one).
"""
from __future__ import annotations

import dataclasses
import ipaddress
import logging
import math
import os
import re
import socket
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import ConfigError

if TYPE_CHECKING:
    from rdma.vrdma import HeartbeatConfig

DEFAULT_CONFIG_PATH = Path("/etc/kspeedfs/kspeedfs.toml")

log = logging.getLogger(__name__)

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50, "e": 1 << 60}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtpe]?)(?:i?b)?\s*$", re.I)


def parse_size(value: object) -> int:
    """``4194304``, ``"4MiB"``, ``"4M"``, ``"0.5GiB"`` → bytes (binary units)."""
    if isinstance(value, bool):
        raise ValueError("a size, not a boolean")
    if isinstance(value, int):
        return value
    m = _SIZE.match(str(value))
    if not m or len(m.group(1)) > 30:
        raise ValueError("expected bytes or a size like '512MiB'")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_size(n: int) -> str:
    for unit, mult in (("PiB", 1 << 50), ("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20),
                       ("KiB", 1 << 10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{unit}"
    return str(n)


def _size(default: str, doc: str) -> Any:
    return field(default=parse_size(default), metadata={"size": True, "doc": doc})


def _opt(default: Any, doc: str) -> Any:
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"doc": doc})
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


def pages_location(value: str) -> str:
    """A ``store.pages`` URL checked: a bucket URL itself, ``file:///DIR`` its directory;
    ``ConfigError`` (one line) for any other."""
    if value.startswith("file://"):
        path = value.removeprefix("file://")
        if not path.startswith("/") or "?" in path or "#" in path:
            raise ConfigError(f"store.pages: {value!r} is not file:///ABSOLUTE/DIR")
        return path
    from .objstore.url import ObjectUrl

    try:
        ObjectUrl.parse(value)
    except ConfigError as e:
        raise ConfigError(f"store.pages: {e} (nor file:///DIR)") from None
    return value


@dataclass
class StoreConfig:
    """Where dataset manifests live (``manifest/store/``)."""

    backend: str = _opt("embedded", "'embedded' (local directory, no server) or 'etcd'")
    path: str = _opt("/var/lib/kspeedfs/store", "embedded store directory")
    etcd: list[str] = _opt(["http://127.0.0.1:2379"], "etcd endpoints (http[s]://host:port)")
    etcd_prefix: str = _opt("/kspeedfs/", "key prefix of everything kspeedfs keeps in etcd")
    etcd_user: str = _opt("", "etcd user name (auth enabled when set)")
    etcd_password: str = field(default="", metadata={"doc": "etcd password (kspeedfs config "
                                                      "prints *** when set); given with --set "
                                                      "or -o, every local user reads it in ps: "
                                                      "prefer etcd_password_file",
                                                      "secret": True})
    etcd_password_file: str = _opt("", "file holding the etcd password (a trailing newline "
                                   "is dropped); refused unless mode 0600 or stricter and owned "
                                   "by root or the user reading it; read once per process")
    etcd_ca_cert: str = _opt("", "CA bundle for etcd TLS (https endpoints)")
    etcd_cert: str = _opt("", "client certificate for etcd mutual TLS")
    etcd_key: str = _opt("", "client key for etcd mutual TLS")
    etcd_timeout: float = _opt(5.0, "seconds before an etcd request counts as unavailable")
    etcd_attempt_timeout: float = _opt(1.0, "deadline of one etcd request to one endpoint, s; "
                                       "the next endpoint (rail) is tried after it")
    keep_versions: int = _opt(3, "versions of a dataset `kspeedfs gc` (and import) keeps besides "
                              "mounted and preloaded ones; 0 = keep every version")
    pages: str = _opt("", "where manifest pages go (manifest/pages.py): a directory, or a "
                      "bucket prefix s3://BUCKET/PREFIX (gs://, az://; file:///DIR is a "
                      "directory) reached with the source.* settings and AWS_*/GOOGLE_*/"
                      "AZURE_* as imports are; set on the importing host and on the nodes, "
                      "which copy pages from peers, else from it (mounts read their node's "
                      "copy); empty = etcd keeps manifests whole, the embedded store keeps "
                      "pages in <path>/pages")
    paged_above: int = _size("1MiB", "a manifest inflating past this is stored as pages, "
                             "its root in the store (when the store has a page directory)")
    page_cache: int = _size("1GiB", "manifest pages a mount keeps resident; the rest are "
                            "read again on touch")

    def validate(self) -> None:
        _choice("store.backend", self.backend, ("embedded", "etcd"))
        if self.backend == "etcd" and not self.etcd:
            raise ConfigError("store.etcd: at least one endpoint is needed for backend 'etcd'")
        for ep in self.etcd:
            m = re.match(r"^https?://[^/:\s]+(?::(\d{1,5}))?/?$", ep)
            if not m or (m.group(1) and not 1 <= int(m.group(1)) <= 65535):
                raise ConfigError(f"store.etcd: {ep!r} is not http[s]://host[:port] (port 1..65535)")
        if self.backend == "embedded" and not self.path:
            raise ConfigError("store.path: empty (the embedded store needs a directory)")
        if not self.etcd_prefix or len(self.etcd_prefix) > 256:
            raise ConfigError(f"store.etcd_prefix: {self.etcd_prefix!r} must be 1..256 characters")
        _positive("store.etcd_timeout", self.etcd_timeout, 3600)
        if type(self.keep_versions) is not int or not 0 <= self.keep_versions <= 100000:
            raise ConfigError(f"store.keep_versions: {self.keep_versions} must be in 0..100000")
        _positive("store.etcd_attempt_timeout", self.etcd_attempt_timeout, 3600)
        _range("store.paged_above", self.paged_above, 0, 1 << 40)
        if "://" in self.pages:
            pages_location(self.pages)
        _range("store.page_cache", self.page_cache, 64 << 10, 1 << 44)
        if self.etcd_attempt_timeout > self.etcd_timeout:
            raise ConfigError(f"store.etcd_attempt_timeout: {self.etcd_attempt_timeout} must be "
                              f"<= store.etcd_timeout ({self.etcd_timeout})")
        if self.etcd_password and self.etcd_password_file:
            raise ConfigError("store.etcd_password_file: set it or store.etcd_password, not both")

    def pages_url(self) -> str | None:
        """``store.pages`` when it names a bucket prefix (``s3://``, ``gs://``, ``az://``)."""
        return self.pages if "://" in self.pages and not self.pages.startswith("file://") else None

    def pages_dir(self) -> str:
        """``store.pages`` when it names a directory (``file:///DIR`` as ``/DIR``), else ""."""
        if self.pages.startswith("file://"):
            return pages_location(self.pages)
        return "" if "://" in self.pages else self.pages

    def password(self) -> str:
        """The etcd password: ``etcd_password_file``'s contents when set (a trailing
        newline dropped), else ``etcd_password``. Like :meth:`ClusterConfig.secret`, the
        file is refused with a ConfigError naming it when it cannot be read, is empty,
        lets group or others access it (``mode & 0o077``), or belongs to a user other
        than root and the reader (that user could read or replace it)."""
        if not self.etcd_password_file:
            return self.etcd_password
        where = f"store.etcd_password_file {self.etcd_password_file}"
        try:
            with open(self.etcd_password_file, "rb") as f:
                st = os.fstat(f.fileno())
                data = f.read(4097)
        except OSError as e:
            raise ConfigError(f"{where}: {e.strerror}") from None
        if st.st_mode & 0o077:
            raise ConfigError(f"{where}: mode {st.st_mode & 0o777:04o} lets group or others "
                              f"read the password; chmod 600 {self.etcd_password_file}")
        if st.st_uid not in (0, os.geteuid()):
            raise ConfigError(f"{where}: owned by uid {st.st_uid}, who can read or replace the "
                              f"password; chown root {self.etcd_password_file}")
        password = data.rstrip(b"\r\n")
        if not password or len(data) > 4096:
            raise ConfigError(f"{where}: the password is empty or longer than 4096 bytes")
        try:
            return password.decode()
        except UnicodeDecodeError:
            raise ConfigError(f"{where}: the password is not UTF-8 text") from None


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
        _range("import.threads", self.threads, 0, 1024)


@dataclass
class CacheConfig:
    """The local chunk cache (``cache/``): memory, then an optional disk tier."""

    memory: int = _size("1GiB", "memory tier capacity (verified chunks, LRU)")
    disk_dir: str = _opt("", "disk tier directory; empty = no disk tier")
    disk: int = _size("0", "disk tier capacity; 0 = no disk tier")

    def validate(self) -> None:
        _memory("cache.memory", self.memory, 8 << 20)
        _range("cache.disk", self.disk, 0, 1 << 50)
        if self.disk and not self.disk_dir:
            raise ConfigError("cache.disk is set but cache.disk_dir is empty")

    def check_host(self) -> None:
        """At mount/node start: the memory tier fits in free memory (a warning: it fills
        lazily), the disk tier in its file system (an error)."""
        _check_available("cache.memory", self.memory, fatal=False)
        if self.disk and self.disk_dir:
            probe = Path(self.disk_dir)
            while not probe.exists() and probe != probe.parent:
                probe = probe.parent
            st = os.statvfs(probe)
            if self.disk > st.f_blocks * st.f_frsize:
                raise ConfigError(f"cache.disk: {format_size(self.disk)} is more than the whole "
                                  f"file system of cache.disk_dir {self.disk_dir} "
                                  f"({format_size(st.f_blocks * st.f_frsize)})")


@dataclass
class FuseConfig:
    """The mount (``fuse/``, ``daemon.py``) and the kernel knobs set after mounting."""

    allow_other: bool = _opt(False, "let other users see the mount (needs user_allow_other for non-root)")
    entry_timeout: float = _opt(86400.0, "kernel dentry cache lifetime, s (the snapshot is immutable)")
    attr_timeout: float = _opt(86400.0, "kernel attribute cache lifetime, s")
    prefetch_chunks: int = _opt(4, "chunks fetched ahead of a sequential reader")
    blksize: int = _size("0", "st_blksize reported for files; 0 = automatic: 4 KiB with the "
                               "native engine, the manifest's block size (import.block_size) with "
                               "pyfuse3. Python's open() buffers st_blksize bytes per read: 4 KiB "
                               "records read 2.66x faster warm, 1.71x cold with 4 KiB than with "
                               "the block size on the native engine, where a small READ costs "
                               "microseconds; on pyfuse3 4 KiB lost warm (0.45x); the chunk "
                               "size loses everywhere (sweep-blksize)")
    xattrs: bool = _opt(False, "serve user.kspeedfs.* xattrs (stats, checksums); off: the kernel "
                               "stops asking, and ls -l sends no 2 GETXATTRs per entry")
    push_pages: bool = _opt(False, "store prefetched chunks in the kernel page cache (FUSE_NOTIFY_STORE) "
                                  "so sequential readers skip the READ round trip")
    max_background: int = _opt(64, "FUSE max_background, set via sysfs after mount (kernel default 12)")
    congestion_threshold: int = _opt(48, "FUSE congestion_threshold via sysfs "
                                         "(default 3/4 of max_background)")
    read_ahead_kb: int = _opt(4096, "bdi read_ahead_kb via sysfs (kernel default 128)")
    workers: int = _opt(16, "threads for blocking source/disk I/O")
    engine: str = _opt("native", "FUSE engine: 'native' (C request threads answer metadata and "
                       "cached reads, Python only misses: fuse/native.py) or 'pyfuse3' (the "
                       "portable reference engine); native falls back to pyfuse3 where it "
                       "cannot mount (not root, not built)")
    resume_patience: float = _opt(60.0, "native engine: seconds the supervisor keeps starting a "
                                  "new daemon after a crash while none can start (e.g. its "
                                  "source gone); then it gives up and the mount reports "
                                  "ENOTCONN (fuse/supervisor.py)")
    threads: int = _opt(0, "native engine: request threads; 0 = one per core (at most 253: "
                        "a crash or an upgrade hands their fds over in one message)")
    max_pages: int = _opt(256, "native engine: pages per FUSE request, negotiated at INIT "
                          "(256 = 1 MiB READs; pyfuse3 gets the kernel default, 32)")
    io_uring: str = _opt("off", "native engine: 'auto' serves FUSE over io_uring queues (one per "
                         "CPU) when the kernel offers it (6.14+, /sys/module/fuse/parameters/"
                         "enable_uring = Y; kspeedfs never sets it), else /dev/fuse; 'off': "
                         "/dev/fuse. An io_uring mount is not supervised and cannot be "
                         "upgraded: the kernel cannot move ring entries to another process "
                         "(docs/design.md). Off by default: no consistent gain on 2 vCPUs "
                         "(docs/design.md, 'FUSE over io_uring'), and it costs the mount its "
                         "supervisor and upgrades")
    splice: bool = _opt(True, "native engine: READ replies of 256 KiB or more go by vmsplice + "
                        "splice instead of writev (fewer page pins in the kernel's copy: "
                        "docs/design.md 'Replies by splice'); a reply that does not fit a pipe "
                        "(a 1 MiB READ's needs fs.pipe-max-size >= 2 MiB or CAP_SYS_RESOURCE) "
                        "is written as before")

    def validate(self) -> None:
        if self.engine not in ("native", "pyfuse3"):
            raise ConfigError(f"fuse.engine: {self.engine!r} must be 'native' or 'pyfuse3'")
        if self.io_uring not in ("off", "auto"):
            raise ConfigError(f"fuse.io_uring: {self.io_uring!r} must be 'off' or 'auto'")
        _range("fuse.threads", self.threads, 0, 253)     # fuse/upgrade.py MAX_FDS
        _positive("fuse.resume_patience", self.resume_patience, 86400.0)
        _range("fuse.max_pages", self.max_pages, 1, 256)
        if self.blksize and (self.blksize < 512 or self.blksize > 1 << 30
                             or self.blksize & (self.blksize - 1)):
            raise ConfigError(f"fuse.blksize: {self.blksize} must be 0 or a power of two in 512..1GiB")
        _positive("fuse.entry_timeout", self.entry_timeout, _YEAR)
        _positive("fuse.attr_timeout", self.attr_timeout, _YEAR)
        _range("fuse.prefetch_chunks", self.prefetch_chunks, 0, 1024)
        if not 1 <= self.max_background <= 65535:
            raise ConfigError(f"fuse.max_background: {self.max_background} must be in 1..65535")
        if not 1 <= self.congestion_threshold <= self.max_background:
            raise ConfigError(
                f"fuse.congestion_threshold: {self.congestion_threshold} must be in 1..max_background"
            )
        if not 0 <= self.read_ahead_kb <= 1 << 20:
            raise ConfigError(f"fuse.read_ahead_kb: {self.read_ahead_kb} must be in 0..1048576")
        _range("fuse.workers", self.workers, 1, 1024)


#: a principal of ``cluster.host_readers`` (user and group names as useradd allows them)
PRINCIPAL = re.compile(r"^(?:\*|uid:\d{1,10}|gid:\d{1,10}"
                       r"|(?:user|group):[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}\$?)$")


def _host_readers(readers: dict[str, list[str]]) -> None:
    """``cluster.host_readers``: dataset names to lists of principals (``PRINCIPAL``)."""
    for dataset, principals in readers.items():
        if not dataset or not isinstance(principals, list):
            raise ConfigError(f"cluster.host_readers: {dataset!r} must name a dataset and map "
                              "to a list of principals")
        for p in principals:
            if not isinstance(p, str) or not PRINCIPAL.match(p):
                raise ConfigError(f"cluster.host_readers: {p!r} (for {dataset}) is not "
                                  "'uid:N', 'gid:N', 'user:NAME', 'group:NAME' or '*'")


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
    arena_dir: str = _opt("/dev/shm/kspeedfs", "node: the arena and its index live in files "
                          "here (<cluster>-<node>.arena/.index), so a restarted node re-adopts "
                          "its verified chunks instead of reloading them; made 0700, refused "
                          "unless private to the node's user; '' = anonymous memory")
    page_copy: str = _opt("/var/cache/kspeedfs/pages", "node: its host's copy of the manifest "
                          "pages of every paged version it preloads (<hh>/<sha256>, as "
                          "store.pages), fetched from peers, else store.pages; mounts on the "
                          "host read it before store.pages and ask the node for what it lacks "
                          "on its socket .ask there (cluster/page_copy.py, page_ask.py); made "
                          "0700 when first needed, refused unless private to the node's user; "
                          "one node per directory; '' = none")
    segment_bytes: int = _size("64MiB", "node: the arena is cut into segments of this size (a "
                               "multiple of slot_size; the last may be shorter), each its own "
                               "file or memfd: what a local reader is granted (cluster/grant.py)")
    host_readers: dict[str, list[str]] = _opt({}, "node: dataset -> local principals who may map "
                                              "its chunks from this node's memory over "
                                              "grant_socket: 'uid:N', 'gid:N', 'user:NAME', "
                                              "'group:NAME' or '*' (any local user); root always "
                                              "may; a dataset listed (even with []) gets "
                                              "segments of its own, one not listed none")
    grant_socket: str = _opt("/run/kspeedfs/{cluster}-{node}.grant",
                             "node: the unix socket granting host_readers their datasets' "
                             "segments ({cluster}: the cluster's tag as in arena_dir's names, "
                             "{node}: the node's name); served only when host_readers is set; "
                             "'' = none")
    lease_ttl: int = _opt(5, "node: membership lease TTL, s (a dead node leaves after this)")
    leave_grace: float = _opt(5.0, "a node whose lease lapsed keeps its placement this long, s; "
                              "back within it, nothing is re-replicated (membership.py)")
    preload_workers: int = _opt(4, "node: chunks loaded concurrently by preload/re-replication")
    hb_interval: float = _opt(0.010, "vRDMA heartbeat interval per path, s")
    hb_miss: int = _opt(5, "heartbeats missed before a path is DOWN (detection ~ miss x interval)")
    hb_idle_interval: float = _opt(0.100, "heartbeat interval of a peer connection with no READ "
                                   "from Python for 1 s, s (the next READ restores hb_interval "
                                   "at once)")
    hb_quiet_interval: float = _opt(1.0, "heartbeat interval of a peer connection with no READ "
                                    "at all (nor one of the native fetch's) for 1 s, s")
    peer_timeout: float = _opt(0.5, "all paths to a peer dead this long -> try the next replica, s")
    hedge: bool = _opt(True, "READ the next replica too when a peer READ is slow (mounts, and "
                       "nodes re-replicating) "
                       "(cluster/hedge.py: the rule and its measurements)")
    hedge_factor: float = _opt(2.0, "hedge a READ after p99 x this of the peer's recent READs of its size")
    hedge_floor: float = _opt(0.002, "never hedge a READ younger than this, s")
    hedge_cap: float = _opt(0.1, "always hedge a READ older than this, s (< peer_timeout)")
    hedge_budget: float = _opt(0.05, "hedged bytes at most this fraction of the bytes READ")
    hedge_suspect_time: float = _opt(1.0, "a peer overrunning twice in a row is tried last "
                                     "for this long, s (or until a READ of it is in time)")
    native_fetch: bool = _opt(True, "a mount on the native FUSE engine with the soft provider "
                              "READs, verifies and answers chunks whose replica slot it knows "
                              "in C (cluster/native/fetch.py); mounts without a disk tier; "
                              "the library READs small files' extents from peers in its "
                              "reading threads, in C (cluster/peer_wait.py)")

    def validate(self) -> None:
        if not 1 <= self.replicas <= 16:
            raise ConfigError(f"cluster.replicas: {self.replicas} must be in 1..16")
        if self.slot_size % 4096 or not 64 << 10 <= self.slot_size <= 1 << 30:
            raise ConfigError(f"cluster.slot_size: {self.slot_size} must be a multiple of 4 KiB "
                              "in 64KiB..1GiB")
        _memory("cluster.memory", self.memory, self.slot_size * 2)
        if self.segment_bytes < self.slot_size or self.segment_bytes % self.slot_size:
            raise ConfigError(f"cluster.segment_bytes: {self.segment_bytes} must be a multiple "
                              f"of cluster.slot_size ({self.slot_size})")
        _host_readers(self.host_readers)
        if self.page_copy and not self.page_copy.startswith("/"):
            raise ConfigError(f"cluster.page_copy: {self.page_copy!r} must be an absolute path "
                              "(or '' for none)")
        if self.grant_socket and not self.grant_socket.startswith("/"):
            raise ConfigError(f"cluster.grant_socket: {self.grant_socket!r} must be an absolute "
                              "path (or '' for none)")
        _range("cluster.port", self.port, 1, 65535)
        _range("cluster.rpc_port", self.rpc_port, 1, 65535)
        if self.rpc_port == self.port:
            raise ConfigError(f"cluster.rpc_port: {self.rpc_port} must differ from cluster.port")
        for nic in self.nics:
            try:
                ipaddress.ip_address(nic)
            except ValueError:
                raise ConfigError(f"cluster.nics: {nic!r} is not an IP address") from None
        if len(set(self.nics)) != len(self.nics):
            raise ConfigError(f"cluster.nics: {self.nics} lists an address twice")
        _range("cluster.preload_workers", self.preload_workers, 1, 256)
        _choice("cluster.provider", self.provider, ("", "soft", "verbs"))
        _range("cluster.lease_ttl", self.lease_ttl, 1, 3600)
        _range("cluster.leave_grace", self.leave_grace, 0, 3600)     # nan fails too
        _positive("cluster.hb_interval", self.hb_interval, 60)
        if self.hb_idle_interval < self.hb_interval:
            raise ConfigError(f"cluster.hb_idle_interval: {self.hb_idle_interval} must be >= "
                              f"cluster.hb_interval ({self.hb_interval})")
        _positive("cluster.hb_idle_interval", self.hb_idle_interval, 60)
        if self.hb_quiet_interval < self.hb_idle_interval:
            raise ConfigError(f"cluster.hb_quiet_interval: {self.hb_quiet_interval} must be >= "
                              f"cluster.hb_idle_interval ({self.hb_idle_interval})")
        _positive("cluster.hb_quiet_interval", self.hb_quiet_interval, 600)
        _positive("cluster.peer_timeout", self.peer_timeout, 3600)
        _range("cluster.hedge_factor", self.hedge_factor, 1, 100)
        _positive("cluster.hedge_floor", self.hedge_floor, 60)
        _positive("cluster.hedge_cap", self.hedge_cap, 60)
        if not self.hedge_floor <= self.hedge_cap < self.peer_timeout:
            raise ConfigError(f"cluster.hedge_cap: {self.hedge_cap} must be >= cluster.hedge_floor "
                              f"({self.hedge_floor}) and < cluster.peer_timeout ({self.peer_timeout})")
        _range("cluster.hedge_budget", self.hedge_budget, 0, 1)
        _range("cluster.hedge_suspect_time", self.hedge_suspect_time, 0, 3600)
        _range("cluster.hb_miss", self.hb_miss, 2, 1000)

    def check_host(self, node: bool) -> None:
        """At node/mount start, on the host that runs it: every ``nics`` address is one of
        this host's (a bind test: nothing is sent) and, for a ``node``, its arena fits in
        the memory available now (an error: the arena is allocated at start)."""
        if node:
            _check_available("cluster.memory", self.memory, fatal=True)
        for nic in self.nics:
            family = socket.AF_INET6 if ":" in nic else socket.AF_INET
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                try:
                    s.bind((nic, 0))
                except OSError as e:
                    raise ConfigError(f"cluster.nics: {nic} is not an address of this host "
                                      f"({e.strerror})") from None

    def heartbeat(self) -> HeartbeatConfig:
        """The vRDMA heartbeat and failover knobs every endpoint of this cluster uses
        (nodes and mounts alike): ``hb_interval``, ``hb_miss``, ``hb_idle_interval``,
        ``hb_quiet_interval`` and ``peer_timeout`` as the grace before a peer with no
        live path is unreachable.
        Imports ``rdma`` here, not at module level, so ``kspeedfs --help`` never does."""
        from rdma.vrdma import HeartbeatConfig

        return HeartbeatConfig(interval=self.hb_interval, miss_threshold=self.hb_miss,
                               suspect_after=min(2, self.hb_miss),
                               unreachable_grace=self.peer_timeout,
                               idle_interval=self.hb_idle_interval,
                               quiet_interval=self.hb_quiet_interval)

    def secret(self) -> bytes:
        """The shared secret: the file's bytes, surrounding whitespace stripped, used as
        they are (``kspeedfs secret generate`` writes 32 random bytes as 64 hex digits;
        a raw binary file works too). Refused, with a ConfigError naming the file:

        - a file group or others may access (``mode & 0o077``): ``chmod 600`` it;
        - fewer than 16 bytes (or over 4096), or fewer than 6 distinct byte values;
        - under 128 bits by :func:`secret_bits` (``passwordpassword``, short words).
        """
        where = f"cluster.secret_file {self.secret_file}"
        try:
            with open(self.secret_file, "rb") as f:
                mode = os.fstat(f.fileno()).st_mode
                data = f.read(4097).strip()
        except OSError as e:
            raise ConfigError(f"{where}: {e.strerror} "
                              "(every node and mount of a cluster needs the same secret)") from None
        if mode & 0o077:
            raise ConfigError(f"{where}: mode {mode & 0o777:04o} lets group or others read the "
                              f"secret; chmod 600 {self.secret_file}")
        if not 16 <= len(data) <= 4096:
            raise ConfigError(f"{where}: the secret is not 16..4096 bytes long "
                              "(kspeedfs secret generate makes a good one)")
        bits = secret_bits(data)
        if len(set(data)) < 6 or bits < 128:
            raise ConfigError(f"{where}: the secret is too guessable (about {bits:.0f} bits, "
                              "at least 128 needed); kspeedfs secret generate makes a good one")
        return data


def secret_bits(data: bytes) -> float:
    """A conservative entropy estimate of a secret: the length of its non-repeating part
    (a secret made of two or more copies of a pattern counts as the pattern:
    ``passwordpassword`` is 8 characters) times log2 of its alphabet. The alphabet is 256
    for binary data; for printable ASCII, 10 for digits only, 16 for hex (one case), else
    the sum of the classes used (26 lower, 26 upper, 10 digits, 33 other). So random hex
    needs 32 digits, a random mix of all classes 20 characters, and lowercase words 28."""
    n = len(data)
    period = n
    for p in range(1, n // 2 + 1):              # smallest pattern repeated at least twice
        if data == (data[:p] * (n // p + 1))[:n]:
            period = p
            break
    text = data.decode("ascii", "replace")
    if not all(32 <= b < 127 for b in data):
        alphabet = 256
    elif text.isdigit():
        alphabet = 10
    elif re.fullmatch(r"[0-9a-f]+|[0-9A-F]+", text):
        alphabet = 16
    else:
        alphabet = sum(size for pattern, size in ((r"[a-z]", 26), (r"[A-Z]", 26), (r"[0-9]", 10),
                                                   (r"[^a-zA-Z0-9]", 33)) if re.search(pattern, text))
    return period * math.log2(alphabet)


@dataclass
class SourceConfig:
    """Object-store sources: ``kspeedfs import s3://BUCKET/PREFIX`` (also ``gs://BUCKET/PREFIX``
    and ``az://CONTAINER/PREFIX``) and the origin that reads such a dataset back
    (``kspeedfs/objstore/``). A key left empty falls back to what each platform's own tools
    read: for S3 ``AWS_ENDPOINT_URL``, ``AWS_REGION``/``AWS_DEFAULT_REGION``, ``AWS_PROFILE``,
    ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``, ``~/.aws/config``
    and ``~/.aws/credentials``, an instance role; for GCS ``GOOGLE_APPLICATION_CREDENTIALS``,
    gcloud's application-default credentials, ``STORAGE_EMULATOR_HOST``; for Azure
    ``AZURE_STORAGE_CONNECTION_STRING``, ``AZURE_STORAGE_ACCOUNT`` with ``AZURE_STORAGE_KEY``
    or ``AZURE_STORAGE_SAS_TOKEN``, a service principal (``AZURE_CLIENT_ID``, ...), a
    managed identity. Credentials never leave the process: not in the manifest, etcd, logs
    or ``kspeedfs config``."""

    endpoint: str = _opt("", "S3 endpoint URL (MinIO, a local server); empty = AWS_ENDPOINT_URL "
                         "or the profile's, else AWS; plain http only when the URL says http://")
    region: str = _opt("", "region; empty = AWS_REGION, AWS_DEFAULT_REGION or the profile's")
    profile: str = _opt("", "profile of ~/.aws/config and ~/.aws/credentials; empty = AWS_PROFILE")
    access_key_id: str = _opt("", "access key id; empty = the AWS credential chain "
                              "(environment, profile files, instance role)")
    secret_access_key: str = field(default="", metadata={
        "doc": "secret access key (kspeedfs config prints ***); prefer the environment or "
               "~/.aws/credentials", "secret": True})
    session_token: str = field(default="", metadata={
        "doc": "session token of temporary credentials (printed as ***)", "secret": True})
    gcs_endpoint: str = _opt("", "gs:// endpoint URL; empty = STORAGE_EMULATOR_HOST (an emulator: "
                             "requests unsigned), else Google's")
    gcs_credentials: str = _opt("", "gs:// credentials file (service account or gcloud ADC JSON); "
                                "empty = GOOGLE_APPLICATION_CREDENTIALS, else gcloud's default "
                                "file, else the instance's service account")
    azure_account: str = _opt("", "az:// storage account; empty = AZURE_STORAGE_ACCOUNT or the "
                              "connection string's AccountName")
    azure_endpoint: str = _opt("", "az:// blob endpoint URL (Azurite: http://HOST:PORT/ACCOUNT); "
                               "empty = the connection string's BlobEndpoint, else "
                               "https://ACCOUNT.blob.core.windows.net")
    azure_key: str = field(default="", metadata={
        "doc": "az:// account key (printed as ***); empty = AZURE_STORAGE_KEY or the connection "
               "string's AccountKey", "secret": True})
    azure_sas: str = field(default="", metadata={
        "doc": "az:// SAS token (printed as ***); empty = AZURE_STORAGE_SAS_TOKEN or the "
               "connection string's SharedAccessSignature", "secret": True})
    azure_connection_string: str = field(default="", metadata={
        "doc": "az:// connection string (printed as ***); empty = AZURE_STORAGE_CONNECTION_STRING",
        "secret": True})
    max_inflight: int = _opt(16, "ranged GETs in flight per chunk load, and import's readers")
    retries: int = _opt(5, "attempts per request: the client retries 5xx, SlowDown, 429, "
                        "timeouts and resets with jittered exponential backoff")
    timeout: float = _opt(10.0, "connect and read timeout of one attempt, s")
    read_deadline: float = _opt(60.0, "one read from the source end to end, s: every request's "
                                "attempts, timeouts and backoff; past it the reader gets "
                                "ETIMEDOUT and the next read tries again")

    def validate(self) -> None:
        for key in ("endpoint", "gcs_endpoint", "azure_endpoint"):
            value = getattr(self, key)
            path = "(/[^/\\s]+)?" if key == "azure_endpoint" else ""
            if value and not re.match(rf"^https?://[^/\s]+{path}/?$", value):
                raise ConfigError(f"source.{key}: {value!r} is not http[s]://host[:port]"
                                  + ("[/ACCOUNT]" if path else ""))
        if bool(self.access_key_id) != bool(self.secret_access_key):
            raise ConfigError("source.access_key_id: set it and source.secret_access_key together")
        _range("source.max_inflight", self.max_inflight, 1, 256)
        _range("source.retries", self.retries, 1, 20)
        _positive("source.timeout", self.timeout, 3600)
        _positive("source.read_deadline", self.read_deadline, 3600)


@dataclass
class LogConfig:
    """Where the daemon logs (``log.py``)."""

    dir: str = _opt("/var/log/kspeedfs", "daemon log directory (one file per mount)")
    level: str = _opt("INFO", "DEBUG, INFO, WARNING or ERROR")
    slow_op: float = _opt(1.0, "log a warning for FUSE operations slower than this, s")

    def validate(self) -> None:
        _choice("log.level", self.level.upper(), ("DEBUG", "INFO", "WARNING", "ERROR"))


@dataclass
class MetricsConfig:
    """Prometheus metrics over HTTP (``metrics.py``): ``host:port`` or ``:port`` (every
    interface); empty = off.

    Mounts default to off: several mounts on one host would collide on any fixed port,
    and a mount without a port starts no thread and opens no socket (the read path keeps
    its plain counters either way). A node is one per machine, so it defaults to a fixed
    loopback port (scrape it there, or set ``node_listen = ":9470"`` for a remote
    Prometheus). A port that cannot be bound is logged as an error; the daemon runs on."""

    listen: str = _opt("", "mount daemon: serve metrics at host:port (e.g. '127.0.0.1:9471'); '' = off")
    node_listen: str = _opt("127.0.0.1:9470", "node daemon: serve metrics at host:port; '' = off")

    def validate(self) -> None:
        a = parse_listen("metrics.listen", self.listen)
        b = parse_listen("metrics.node_listen", self.node_listen)
        if a and b and a[1] == b[1] and (a[0] == b[0] or "0.0.0.0" in (a[0], b[0])):
            raise ConfigError(f"metrics.listen: {self.listen!r} would collide with "
                              f"metrics.node_listen ({self.node_listen!r}) on one host")


def parse_listen(key: str, value: str) -> tuple[str, int] | None:
    """``"host:port"`` / ``":port"`` → ``(ip, port)``; ``""`` → None. The host must be an
    IPv4 address or ``localhost`` (bound at start: an address not of this host fails there)."""
    if not value:
        return None
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"{key}: {value!r} is not host:port or :port (port 1..65535)")
    host = host or "0.0.0.0"
    if host == "localhost":
        host = "127.0.0.1"
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        raise ConfigError(f"{key}: {value!r}: the host must be an IPv4 address") from None
    return host, int(port)


@dataclass
class Config:
    store: StoreConfig = field(default_factory=StoreConfig)
    import_: ImportConfig = field(default_factory=ImportConfig, metadata={"toml": "import"})
    cache: CacheConfig = field(default_factory=CacheConfig)
    fuse: FuseConfig = field(default_factory=FuseConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    source: SourceConfig = field(default_factory=SourceConfig)
    log: LogConfig = field(default_factory=LogConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    source_path: str = field(default="", metadata={"skip": True})  # file the config came from
    # "section.key" -> where its value came from (file path, environment, command line)
    sources: dict[str, str] = field(default_factory=dict, metadata={"skip": True})

    def validate(self) -> Config:
        """Every section's ``validate()``; an error gets the source of the key it names
        first (each message starts with that key)."""
        for section in _sections(self):
            try:
                getattr(self, section.name).validate()
            except ConfigError as e:
                key = re.match(r"[a-z_]+\.[a-z_]+", str(e))
                source = self.sources.get(key.group(0), "default") if key else "default"
                raise ConfigError(f"{e} (from {source})") from None
        return self

    def to_toml(self) -> str:
        lines = [f"# effective kspeedfs configuration (file: {self.source_path or 'none'})"]
        for section in _sections(self):
            obj = getattr(self, section.name)
            lines.append(f"\n[{_toml_name(section)}]")
            for f in dataclasses.fields(obj):
                v = getattr(obj, f.name)
                shown = format_size(v) if f.metadata.get("size") else v
                if f.metadata.get("secret") and v:
                    shown = "***"           # never print a password; the secret_file is a path
                lines.append(f"{f.name} = {_toml_value(shown)}  # {f.metadata.get('doc', '')}")
        return "\n".join(lines) + "\n"


def _sections(cfg: Config) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(cfg) if not f.metadata.get("skip")]


def _toml_name(f: dataclasses.Field[Any]) -> str:
    name: str = f.metadata.get("toml", f.name)
    return name


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_value(str(k))} = {_toml_value(x)}" for k, x in v.items()) + "}"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(allowed)}")


_YEAR = 365 * 86400.0


def _positive(key: str, value: float, most: float = math.inf) -> None:
    """A duration: finite, > 0 and <= ``most`` seconds."""
    if not (0 < value <= most and math.isfinite(value)):
        raise ConfigError(f"{key}: {value} must be > 0" + (f" and <= {most:g}" if most < math.inf else ""))


def _range(key: str, value: float, lo: float, hi: float) -> None:
    if not lo <= value <= hi:
        raise ConfigError(f"{key}: {value} must be in {lo}..{hi}")


def _meminfo(field_name: str) -> int | None:
    """A /proc/meminfo field in bytes; None where there is none (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _memory(key: str, value: int, least: int) -> None:
    """A memory size: at least ``least`` and at most this host's physical RAM."""
    if value < least:
        raise ConfigError(f"{key}: {value} is too small (at least {format_size(least)})")
    total = _meminfo("MemTotal")
    if total is not None and value > total:
        raise ConfigError(f"{key}: {format_size(value)} is more than this host's physical memory "
                          f"({total >> 20} MiB)")


def _check_available(key: str, value: int, fatal: bool) -> None:
    avail = _meminfo("MemAvailable")
    if avail is None or value <= avail:
        return
    msg = f"{key}: {format_size(value)} is more than the memory available now ({avail >> 20} MiB)"
    if fatal:
        raise ConfigError(msg)
    log.warning("%s; the cache may push the system into swap or the OOM killer", msg)


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
            if isinstance(value, bool):
                raise ValueError("expected a number")
            number = float(value)
            if not math.isfinite(number):
                raise ValueError("expected a finite number")
            return number
        if typ.startswith("dict"):
            return _coerce_readers(value)
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


def _coerce_readers(value: Any) -> dict[str, list[str]]:
    """``{"ds": ["uid:1000"]}`` (TOML) or ``"ds=uid:1000,gid:100;other=*"`` (environment,
    flags) → dataset → principals (checked by ``validate``)."""
    if isinstance(value, str):
        out: dict[str, list[str]] = {}
        for part in filter(None, (p.strip() for p in value.split(";"))):
            dataset, sep, principals = part.partition("=")
            if not sep or not dataset.strip():
                raise ValueError("expected 'dataset=principal,...;dataset=...'")
            out[dataset.strip()] = [x.strip() for x in principals.split(",") if x.strip()]
        return out
    if not isinstance(value, dict) or not all(isinstance(v, list) for v in value.values()):
        raise ValueError("expected a table of dataset = [principals]")
    return {str(k): [str(x) for x in v] for k, v in value.items()}


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
        cfg.sources[f"{section_name}.{name}"] = source
        if fields[name].metadata.get("secret") and source == "command line" and value:
            instead = (f"{section_name}.{name}_file (mode 0600)" if f"{name}_file" in fields
                       else "the environment or a config file of mode 0600")
            log.warning("%s given on the command line, where every local user reads it (ps, "
                        "/proc/PID/cmdline); put it in %s instead", key, instead)


def _secrets(cfg: Config) -> Iterator[tuple[str, Any]]:
    """(``section.key``, value) of every key marked secret."""
    for s in _sections(cfg):
        section = getattr(cfg, s.name)
        for f in dataclasses.fields(section):
            if f.metadata.get("secret"):
                yield f"{_toml_name(s)}.{f.name}", getattr(section, f.name)


def secret_keys() -> list[str]:
    """The ``section.key`` names of the keys marked secret: ``kspeedfs config`` prints
    them as ``***``, and no command line kspeedfs runs carries them."""
    return [key for key, _ in _secrets(Config())]


def secret_environment(cfg: Config) -> dict[str, str]:
    """The secret values that came from the command line, as the environment variables
    that give them to a process this one starts (``KSPEEDFS_STORE_ETCD_PASSWORD``): a
    mount's supervisor re-spawns daemons without them in their argv
    (``fuse/supervisor.py``). Secrets from the config file or a ``*_file`` key are read
    there again, and those from the environment are inherited."""
    return {"KSPEEDFS_" + key.replace(".", "_").upper(): str(value)
            for key, value in _secrets(cfg) if value and cfg.sources.get(key) == "command line"}


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
        if not file.is_file():
            raise ConfigError(f"config file {file} is not a regular file")
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
