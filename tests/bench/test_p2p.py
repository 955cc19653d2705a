"""``kvtier bench p2p``: every field end to end (the bench itself fails when a pull misses
or its bytes differ from the serving engine's)."""

from __future__ import annotations

import json

from tests.bench.bench_checks import assert_spread
from tests.cli.test_main import run_cli


def test_bench_p2p_prints_every_field() -> None:
    result = run_cli(
        "bench", "p2p", "--json", "--chunks", "3", "--chunk-size", "16", "--repeats", "1"
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["chunks"] == 3 and data["bytes"] == 3 * data["chunk_bytes"]
    assert_spread(data, "ratio", "pull_gbps", "raw_gbps")
    assert data["pairs"] == 1 and data["load_1m"] >= 0
