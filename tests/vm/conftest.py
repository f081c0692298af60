"""Fixtures of the guest lane: the image (built once per session, cached on disk) and a
skip with the reason where guests cannot run."""
from __future__ import annotations

import pytest

from tests.vm import qemu


@pytest.fixture(scope="session")
def vm_image() -> qemu.Image:
    why = qemu.unavailable()
    if why:
        pytest.skip(f"no Soft-RoCE guests here: {why}")
    try:
        return qemu.ensure_image()
    except qemu.VMUnavailable as exc:
        pytest.skip(f"no Soft-RoCE guests here: {exc}")
