"""Suite-wide options: the slow lane is opt-in (``--run-slow`` or ``./run test-slow``)."""
import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", default=False, help="also run tests marked slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow lane: use --run-slow (./run test-slow)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
