"""The supervisor's sealed copy of a manifest (kspeedfs/manifest/sealed.py): what it gives
back, and that anything else in a memfd is ``ManifestCorrupt`` (the daemon then loads
the store's), never another exception."""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
import zlib

import pytest

from kspeedfs.errors import ManifestCorrupt
from kspeedfs.manifest import sealed
from kspeedfs.manifest.store.base import DatasetInfo


def _dataset(name: str = "ds", version: int = 3) -> tuple[DatasetInfo, bytes]:
    blob = zlib.compress(random.Random(version).randbytes(20_000))
    info = DatasetInfo(name, 0, 1, 2, 20_000, 1, 4 << 20, 0.0, "/data/ds",
                       inflated_size=20_000).sealed(version, blob, 1.7e9)
    return info, blob


def _memfd(data: bytes, seal: bool = True) -> int:
    fd = os.memfd_create("t", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(fd, data)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK
                    | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE)
    return fd


def test_a_sealed_manifest_comes_back_as_it_went_in_and_cannot_be_changed() -> None:
    info, blob = _dataset()
    fd = sealed.seal(info, blob)
    try:
        assert sealed.unseal(fd, "ds", 3) == (info, blob)
        assert sealed.unseal(fd, "ds", None) == (info, blob)
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"y", 100)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 10)
    finally:
        os.close(fd)


@pytest.mark.parametrize("name, version", [("other", 3), ("ds", 2)])
def test_a_copy_of_another_dataset_or_version_is_refused(name: str, version: int) -> None:
    fd = sealed.seal(*_dataset())
    try:
        with pytest.raises(ManifestCorrupt, match="is ds@3, not"):
            sealed.unseal(fd, name, version)
    finally:
        os.close(fd)


def _layout(info: DatasetInfo, blob: bytes) -> bytes:
    record = json.dumps(info.to_json()).encode()
    return hashlib.sha256(record).hexdigest().encode() + b" " + record + b"\n" + blob


def test_an_unsealed_or_altered_copy_is_refused() -> None:
    info, blob = _dataset()
    data = _layout(info, blob)
    bad = json.dumps({}).encode()
    for fd, why in ((_memfd(data, seal=False), "not sealed"),
                    (_memfd(data[:-1] + bytes([data[-1] ^ 1])), "corrupt"),
                    (_memfd(data[:-10]), "corrupt"),
                    (_memfd(b"{}\n" + blob), "does not match"),
                    (_memfd(hashlib.sha256(bad).hexdigest().encode() + b" " + bad + b"\n"
                            + blob), "info record"),
                    (_memfd(b"x" * (sealed.HEADER_LIMIT + 10)), "no info record")):
        try:
            with pytest.raises(ManifestCorrupt, match=why):
                sealed.unseal(fd, "ds", 3)
        finally:
            os.close(fd)


def test_random_and_mutated_copies_are_only_ever_manifest_corrupt() -> None:
    """A fuzz pass: random bytes, and a good copy with bytes flipped, cut or inserted
    (in its header above all), give ``ManifestCorrupt`` or, untouched, the dataset."""
    info, blob = _dataset()
    good = _layout(info, blob)
    header = good.index(b"\n")
    rnd = random.Random(11)
    for i in range(600):
        if i % 3 == 0:
            data = rnd.randbytes(rnd.randrange(0, 2000))
        else:
            data = bytearray(good)
            for _ in range(rnd.randrange(1, 4)):
                at = rnd.randrange(0, header + 1 if rnd.random() < 0.8 else len(data))
                op = rnd.randrange(3)
                if op == 0:
                    data[at] = rnd.randrange(256)
                elif op == 1:
                    del data[at:at + rnd.randrange(1, 8)]
                else:
                    data[at:at] = rnd.randbytes(rnd.randrange(1, 8))
            data = bytes(data)
        fd = _memfd(data)
        try:
            try:
                got = sealed.unseal(fd, "ds", 3)
            except ManifestCorrupt:
                continue
            assert got == (info, blob), data[:header + 10]
        finally:
            os.close(fd)
