"""Fixtures of the object-store tests: one moto server for the module, a bucket per test."""
from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from typing import Any

import pytest

from tests.fixtures.s3 import S3Server

_buckets = itertools.count()


@pytest.fixture(scope="module")
def s3_server() -> Iterator[S3Server]:
    """A real S3 server (moto) on loopback, shared by a module's tests; they isolate
    themselves by bucket."""
    with S3Server() as server:
        yield server


@pytest.fixture
def bucket(s3_server: S3Server) -> tuple[Any, str]:
    """(boto3 client, a new empty bucket's name)."""
    c = s3_server.client()
    name = f"kst-{next(_buckets)}"
    c.create_bucket(Bucket=name)
    return c, name


@pytest.fixture
def aws_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """This process, the CLI it runs and the mount daemons that starts see the test
    server and dummy credentials only (no AWS_* setting of the machine's)."""
    for k in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(k)
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    return s3_server
