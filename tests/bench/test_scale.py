"""Smoke test of ``kvtier bench scale`` at tiny sizes: every curve is measured, the figures
are sane, the plot is a PNG, and the disk files are gone afterwards."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from kvtier.bench import scale
from kvtier.cli.bench import BENCHMARKS


def test_bench_scale_reports_every_curve_and_cleans_up(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    scale.add_arguments(parser)
    plot = tmp_path / "scale.png"
    disk_dir = tmp_path / "disk"
    disk_dir.mkdir()
    args = parser.parse_args(
        [
            "--lookup-tokens", "1024,4096",
            "--disk-files", "100,1000",
            "--rss-chunks", "2000",
            "--threads", "1,3",
            "--throughput-chunks", "1",
            "--duration", "0.2",
            "--redis-tokens", "4096",
            "--repeats", "3",
            "--dir", str(disk_dir),
            "--plot", str(plot),
        ]
    )  # fmt: skip
    result = scale.run(args)

    assert "scale" in BENCHMARKS
    for n in ("1k", "4k"):
        assert result[f"lookup_ms_{n}_tokens"] > 0 and result[f"hash_ms_{n}_tokens"] > 0
    for n in ("100", "1k"):
        assert result[f"disk_open_s_{n}"] > 0 and result[f"disk_scan_open_s_{n}"] > 0
    # the saved index is read instead of 1000 headers: faster even on a loaded machine
    assert result["disk_open_s_1k"] < result["disk_scan_open_s_1k"]
    # a chunk's bookkeeping: more than its 16-byte key, far less than a page of memory
    assert 16 < result["rss_bytes_per_chunk"] < 64 * 1024
    for k in (1, 3):
        assert result[f"cpu_retrieve_gbps_t{k}"] > 0 and result[f"cpu_lookups_per_s_t{k}"] > 0
    assert result["redis_lookup_ms_4k_tokens"] > 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert os.listdir(disk_dir) == []
