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


@pytest.mark.parametrize(("codec", "at_least"), [("fp8", 1.9), ("lossless", 1.3)])
def test_bench_runs_the_tier_with_a_codec(server: RedisServer, codec: str, at_least: float) -> None:
    args = Namespace(url=server.url, chunk_size=4, chunks=2, repeats=1, put_threads=2, codec=codec)
    result = run(args)
    assert result["codec"] == codec and result["codec_ratio"] > at_least
    assert result["get_ratio"] > 0 and result["put_ratio"] > 0
