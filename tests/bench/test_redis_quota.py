"""``kvtier bench redis --quota`` against a real redis-server: its fields, and the check it
makes of what it measured (the evicting tenant ends at exactly its limit)."""

from __future__ import annotations

from argparse import Namespace

from kvtier.bench.redis import run
from kvtier.storage import records
from tests.redis_servers import RedisServer


def test_bench_quota_reports_the_cost_of_a_put_with_and_without_the_ledger() -> None:
    server = RedisServer().start()
    try:
        args = Namespace(url=server.url, chunk_size=4, chunks=2, repeats=1, put_threads=2)
        args.quota = True
        result = run(args)
        with server.client() as client:
            assert client.dbsize() == 0  # chunks and ledgers cleaned up after it
    finally:
        server.cleanup()
    assert result["quota_record_bytes"] == records.header_size() + 4 * 2 * 2 * 2 * 8 * 4
    for field in ("quota_off_put_us", "quota_ledger_put_us", "quota_evict_put_us"):
        assert result[field] > 0
