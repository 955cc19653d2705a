"""``kvtier bench redis`` against a real redis-server: every field."""

from __future__ import annotations

from argparse import Namespace
from collections.abc import Iterator

import pytest

from kvtier.bench.redis import BIG_LAYOUT, run
from kvtier.storage import records
from tests.bench.bench_checks import assert_ratio
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
    chunk_bytes = BIG_LAYOUT.chunk_bytes(2)
    assert result["values"] == 2 and result["bytes"] == 2 * chunk_bytes
    assert result["value_bytes"] == chunk_bytes + records.header_size()  # one record a value
    assert_ratio(result, "put_ratio", "put_gbps", "raw_set_gbps")
    assert_ratio(result, "get_ratio", "get_gbps", "raw_get_gbps")
    assert result["lookup_chunks"] == 512 and result["lookup_ms"] > 0


@pytest.mark.parametrize(("codec", "at_least"), [("fp8", 1.9), ("lossless", 1.3)])
def test_bench_runs_the_tier_with_a_codec(server: RedisServer, codec: str, at_least: float) -> None:
    args = Namespace(url=server.url, chunk_size=4, chunks=2, repeats=1, put_threads=2, codec=codec)
    result = run(args)
    assert result["codec"] == codec and result["codec_ratio"] > at_least
    assert_ratio(result, "put_ratio", "put_gbps", "raw_set_gbps")
    assert_ratio(result, "get_ratio", "get_gbps", "raw_get_gbps")
