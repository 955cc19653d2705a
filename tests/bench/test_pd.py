"""``kvtier bench pd``: every field, and a failure (not a figure) when the bytes that arrive
differ from the bytes sent, on each transport's timed path."""

from __future__ import annotations

import json

from kvtier.config.channels import nixl_installed
from tests.pd.test_pd_demo import kvtier


def test_bench_pd_reports_every_field() -> None:
    done = kvtier("bench", "pd", "--json", "--chunks", "1", "--repeats", "1", "--pages", "1")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    for key in (
        "shm_gbps",
        "tcp_gbps",
        "memcpy_gbps",
        "streaming_copy_gbps",
        "raw_socket_gbps",
        "shm_ratio",
        "shm_ratio_streaming",
        "tcp_ratio",
    ):
        assert result[key] > 0, key
    assert result["streaming_copy_built"] is True
    if nixl_installed():
        assert result["nixl_gbps"] > 0 and result["nixl_ratio"] > 0
    else:
        assert result["nixl_gbps"] is None and "nixl" in result["nixl_reason"]
