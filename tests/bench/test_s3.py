"""``kvtier bench s3`` with the SeaweedFS it starts itself: every field, ratios that are the
medians of pairs within their spread, the 512-chunk lookup whole."""

from __future__ import annotations

from argparse import Namespace

from kvtier.bench.s3 import BIG_LAYOUT, TARGET, run
from kvtier.storage import records
from tests.bench.bench_checks import assert_spread


def test_bench_reports_every_field() -> None:
    args = Namespace(
        endpoint=None,
        bucket="kvtier-bench",
        chunk_size=2,
        chunks=3,
        repeats=1,
        put_threads=2,
        get_threads=2,
    )
    result = run(args)
    chunk_bytes = BIG_LAYOUT.chunk_bytes(2)
    assert result["server"] == "seaweedfs (started)"
    assert result["objects"] == 3 and result["bytes"] == 3 * chunk_bytes
    assert result["object_bytes"] == chunk_bytes + records.header_size()  # one record an object
    assert_spread(result, "put_ratio", "put_gbps", "raw_put_gbps")
    assert_spread(result, "get_ratio", "get_gbps", "raw_get_gbps")
    assert result["pairs"] == 1 and result["load_1m"] >= 0
    assert result["lookup_chunks"] == 512 and result["lookup_ms"] > 0
    assert result["lookup_requests"] == 0  # the index answers a 128k-token lookup
    assert result["target"] == TARGET
    missed = [name for name in ("put_ratio", "get_ratio") if result[name] < TARGET]
    assert [p.split()[0] for p in result.get("problems", [])] == missed


def test_the_command_lists_it() -> None:
    from kvtier.cli.bench import BENCHMARKS

    assert "s3" in BENCHMARKS
