"""``kvtier bench server --json`` runs end to end and reports every field."""

from __future__ import annotations

import json

from tests.cli.test_main import run_cli


def test_bench_server_prints_every_field() -> None:
    result = run_cli(
        "bench", "server", "--json", "--chunks", "2", "--repeats", "1", "--chunk-size", "16",
        "--seconds", "0.2", "--clients", "1,2",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    for field in (
        "store_inproc_gbps",
        "store_server_gbps",
        "store_ratio",
        "retrieve_inproc_gbps",
        "retrieve_server_gbps",
        "retrieve_ratio",
        "store_cpu_ratio",
        "retrieve_cpu_ratio",
        "lookup_rtt_us",
        "lookup_inproc_us",
        "retrieve_gbps_1_clients",
        "retrieve_gbps_2_clients",
    ):
        assert data[field] > 0, field
    assert data["chunk_bytes"] == 2 * 32 * 16 * 1024 * 2
