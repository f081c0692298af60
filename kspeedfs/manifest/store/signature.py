"""Signed etcd records: what a member writes, a member can check, and nobody else can forge.

Threat. An attacker who can write to etcd (no auth, a leaked etcd credential, a
compromised host that runs only etcd) but does not hold the cluster secret. Without
this module such an attacker could publish the next version of a dataset pointing at
a source directory of their own, with checksums that match it (the checksums live in
the same manifest), or register fake nodes that mounts would dial. See
``docs/security.md`` for the whole threat model.

What is signed. Every record whose content decides what bytes a reader gets or whom it
talks to: a dataset version's info record (``datasets/<name>/v<N>/info``, which binds
the manifest blob by size, xxh3-128 *and* SHA-256, and its inflated size, name,
version, source, chunk size and counts: ``base.DatasetInfo``) and a node's record
(``nodes/<node>``). The blob parts need no signature of their own: the signed info
record carries their SHA-256 (xxh3 is not collision resistant against an adversary;
SHA-256 is). Not signed: ``current``/``last`` (an attacker can point ``current`` at
an older signed version or at nothing: a rollback or denial of service, never foreign
bytes), ``preload/``, ``progress/``, ``stats/`` (requests and display).

Format of a signed value (text, readable with ``etcdctl get``)::

    ksig1 <64 hex: HMAC-SHA256(K, len(key) || key || payload)>\\n<payload>

``payload`` is canonical JSON (sorted keys, no spaces: :func:`canonical_json`), and
``key`` the full etcd key the value is written to, prefix included, so a valid record
cannot be moved to another key, dataset, version, node or prefix. The MAC covers the
exact stored bytes, so verifying never depends on re-serialising parsed JSON, and the
payload is not parsed at all before its MAC has verified (:meth:`RecordSigner.open`):
unauthenticated input never reaches the JSON parser.

Why HMAC with a key derived from the cluster secret, not an asymmetric key pair.
Every cluster member (node, mount, the CLI that imports) already holds the cluster
secret: it authenticates the vRDMA and RPC handshakes, so anyone holding it can
already serve bytes to readers as a peer. A signature scheme where only "importers"
hold a private key would protect against a *member* forging manifests, which the
secret already lets a member do worse than; it would add a second secret to
distribute, rotate and protect, and a verify key to install everywhere. Against the
threat above (etcd write access without the secret) an HMAC is exactly as strong, is
in the standard library, and costs microseconds. ``K = HMAC-SHA256(secret,
"kspeedfs etcd record signing v1")``: domain-separated from the handshakes that use
the secret itself, so no MAC made here can be replayed as a handshake response or
the reverse, and a future v2 derivation is a new, disjoint key.

Refusals are logged once per (key, value) (:func:`warn_refused`): a watch that re-lists
every few seconds does not repeat the same line, a new forgery at the same key logs
again.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import struct
import threading
from typing import Any

from ...errors import RecordUnverified

log = logging.getLogger(__name__)

MAGIC = b"ksig1 "
_DERIVATION_LABEL = b"kspeedfs etcd record signing v1"
_MAC_HEX = 64
_HEADER = len(MAGIC) + _MAC_HEX + 1          # magic, hex MAC, newline

_warned: set[tuple[str, bytes]] = set()
_warned_lock = threading.Lock()
_WARNED_MAX = 4096


def derive_key(secret: bytes) -> bytes:
    """The record-signing key of a cluster: HMAC-SHA256(secret, label)."""
    if not secret:
        raise ValueError("empty cluster secret")
    return hmac.new(secret, _DERIVATION_LABEL, hashlib.sha256).digest()


def canonical_json(obj: Any) -> bytes:
    """One serialisation per value: sorted keys, no whitespace, ASCII only."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode()


def warn_refused(key: str, value: bytes, why: str) -> None:
    """Log one line per (key, value) refused; bounded memory."""
    fingerprint = hashlib.sha256(value).digest()[:16]
    with _warned_lock:
        if (key, fingerprint) in _warned:
            return
        if len(_warned) >= _WARNED_MAX:
            _warned.clear()
        _warned.add((key, fingerprint))
    log.warning("refusing etcd key %s: %s (written without this cluster's secret, or by a "
                "cluster with another secret?)", key, why)


class RecordSigner:
    """Signs and verifies values of etcd keys with the cluster's record-signing key."""

    def __init__(self, secret: bytes) -> None:
        self._key = derive_key(secret)

    def __repr__(self) -> str:
        return "RecordSigner(<key>)"

    def _mac(self, key: str, payload: bytes) -> bytes:
        k = key.encode("utf-8", "surrogateescape")
        m = hmac.new(self._key, struct.pack(">I", len(k)), hashlib.sha256)
        m.update(k)
        m.update(payload)
        return m.digest()

    def seal(self, key: str, payload: bytes) -> bytes:
        """The value to store at ``key``: ``payload`` with its MAC in front."""
        return MAGIC + self._mac(key, payload).hex().encode() + b"\n" + payload

    def seal_json(self, key: str, obj: Any) -> bytes:
        return self.seal(key, canonical_json(obj))

    def open(self, key: str, value: bytes) -> bytes:
        """The payload of a value read from ``key``, once its MAC verifies.

        Raises :class:`RecordUnverified` (a ``StoreError``) for anything else: no
        signature, a malformed one, or a MAC made with another key or for another key.
        Logs the refusal once per (key, value)."""
        try:
            why = _check(self, key, value)
        except Exception as e:          # bytes-like checks only; never expected
            why = f"unreadable signature ({type(e).__name__})"
        if why:
            warn_refused(key, bytes(value) if isinstance(value, (bytes, bytearray)) else b"", why)
            raise RecordUnverified(f"etcd key {key}: {why}; refused")
        return bytes(value[_HEADER:])

    def open_json(self, key: str, value: bytes) -> Any:
        """:meth:`open`, then parse the payload (a signed payload that is not JSON is a
        member's bug, reported as :class:`RecordUnverified` too, never as RecursionError)."""
        payload = self.open(key, value)
        try:
            return json.loads(payload)
        except (ValueError, RecursionError) as e:
            raise RecordUnverified(f"etcd key {key}: signed payload is not JSON: {e}") from None


def _check(signer: RecordSigner, key: str, value: bytes) -> str:
    """Why ``value`` does not verify at ``key`` ("" when it does)."""
    if not isinstance(value, (bytes, bytearray)):
        return "not bytes"
    if not value.startswith(MAGIC):
        return "no signature (unsigned record)"
    if len(value) < _HEADER or value[_HEADER - 1:_HEADER] != b"\n":
        return "malformed signature"
    try:
        mac = bytes.fromhex(value[len(MAGIC):_HEADER - 1].decode("ascii"))
    except (ValueError, UnicodeDecodeError):
        return "malformed signature"
    if len(mac) != _MAC_HEX // 2:
        return "malformed signature"
    if not hmac.compare_digest(mac, signer._mac(key, bytes(value[_HEADER:]))):
        return "signature does not verify"
    return ""
