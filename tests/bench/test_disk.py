"""Smoke test of ``kvtier bench disk`` on a tiny run (two 128 KiB chunks)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from kvtier.bench import disk
from tests.bench.bench_checks import assert_ratio


def test_bench_disk_reports_every_field_and_cleans_up(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    disk.add_arguments(parser)
    args = parser.parse_args(
        ["--chunks", "2", "--chunk-size", "1", "--repeats", "1", "--dir", str(tmp_path)]
    )
    result = disk.run(args)
    assert result["chunks"] == 2 and result["chunk_mib"] == 0.125
    assert result["codec"] == "identity" and result["codec_ratio"] == 1.0
    for kind in ("write", "read", "read_cached"):  # each over the plain I/O printed beside it
        assert_ratio(result, f"{kind}_ratio", f"{kind}_gbps", f"raw_{kind}_gbps", places=12)
        parallel = f"raw_parallel_{kind}_gbps"
        assert_ratio(result, f"{kind}_ratio_parallel", f"{kind}_gbps", parallel, places=12)
    assert result["checksum_gbps"] > 0
    assert os.listdir(tmp_path) == []  # its temporary directory is gone


def test_bench_disk_runs_the_tier_with_a_codec(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    disk.add_arguments(parser)
    for codec, at_least in (("fp8", 1.9), ("lossless", 1.3)):
        argv = ["--chunks", "2", "--chunk-size", "4", "--repeats", "1", "--dir", str(tmp_path)]
        result = disk.run(parser.parse_args([*argv, "--codec", codec]))
        assert result["codec"] == codec and result["codec_ratio"] > at_least
        assert_ratio(result, "read_ratio", "read_gbps", "raw_read_gbps", places=12)
        assert_ratio(result, "write_ratio", "write_gbps", "raw_write_gbps", places=12)
