"""Suite-wide options: the slow lane is opt-in (``--run-slow`` or ``./run test-slow``), the
guest lane too (``--run-vm``); every test is marked with its folder's cost layer and the
layers run cheapest first (tests/README.md)."""
import os

# before anything imports grpc: its fork handlers abort a test process that spawns a
# server (fork) while gRPC threads run (seen once in CI-like runs: etcd restart test)
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.fixtures.etcd import EtcdServer


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", default=False, help="also run tests marked slow")
    parser.addoption("--run-vm", action="store_true", default=False,
                     help="also run tests marked vm (Soft-RoCE QEMU guests, tests/vm)")


# The folders are the cost layers, cheapest first; the suite runs them in this order so
# that the first failure names the lowest broken layer (tests/README.md).
LAYERS = ("unit", "etcd", "rdma", "mount", "csi", "s3", "objstore", "cluster", "vm")


def _layer(item: pytest.Item) -> str | None:
    parts = item.path.relative_to(item.config.rootpath).parts
    return parts[1] if len(parts) > 2 and parts[0] == "tests" and parts[1] in LAYERS else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        layer = _layer(item)
        # ``vm`` is not added by folder: the guests run tests/vm/guest/*.py themselves,
        # and the tests that boot guests carry the marker explicitly
        if layer is not None and layer != "vm":
            item.add_marker(getattr(pytest.mark, layer))
    items.sort(key=lambda item: LAYERS.index(_layer(item) or "unit"))   # stable: file order kept
    if not config.getoption("--run-vm"):
        skip_vm = pytest.mark.skip(reason="guest lane: use --run-vm (./run test-vm)")
        for item in items:
            if item.get_closest_marker("vm") is not None:
                item.add_marker(skip_vm)
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow lane: use --run-slow (./run test-slow)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


# -- etcd (tests/fixtures/etcd.py) ------------------------------------------------------
# Imported inside the fixtures so that collecting tests that never use etcd cannot fail
# because of it.

@pytest.fixture(scope="session")
def etcd_server() -> "Iterator[EtcdServer]":
    """One real etcd on 127.0.0.1 for the whole session; tests isolate themselves by key
    prefix. Do not stop or restart it (other tests share it): use ``etcd_server_private``."""
    from tests.fixtures.etcd import EtcdServer

    with EtcdServer(name="kst-session") as server:
        yield server


@pytest.fixture
def etcd_server_private() -> "Iterator[EtcdServer]":
    """An etcd of the test's own, free to ``stop()``, ``start()`` and ``restart()``."""
    from tests.fixtures.etcd import EtcdServer

    with EtcdServer(name="kst-private") as server:
        yield server
