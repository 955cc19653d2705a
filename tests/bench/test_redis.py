"""``kvtier bench redis`` against a real redis-server: every field."""

from __future__ import annotations

from argparse import Namespace
from collections.abc import Iterator

import pytest

from kvtier.bench.redis import run
from tests.redis_servers import RedisServer


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    srv = RedisServer().start()
    try:
        yield srv
    finally:
        srv.cleanup()


def test_bench_reports_every_field(server: RedisServer) -> None:
    args = Namespace(url=server.url, chunk_size=2, chunks=2, repeats=1, put_threads=2)
    result = run(args)
    for field in ("put_gbps", "get_gbps", "raw_set_gbps", "raw_get_gbps", "lookup_ms"):
        assert result[field] > 0, field
    assert result["get_ratio"] > 0 and result["put_ratio"] > 0
    assert result["lookup_chunks"] == 512
