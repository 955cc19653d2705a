"""Smoke test of ``kvtier bench disk`` on a tiny run (two 128 KiB chunks)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from kvtier.bench import disk

FIELDS = (
    "write_gbps",
    "read_gbps",
    "raw_write_gbps",
    "raw_read_gbps",
    "read_ratio",
    "write_ratio",
    "checksum_gbps",
)


def test_bench_disk_reports_every_field_and_cleans_up(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    disk.add_arguments(parser)
    args = parser.parse_args(
        ["--chunks", "2", "--chunk-size", "1", "--repeats", "1", "--dir", str(tmp_path)]
    )
    result = disk.run(args)
    for field in FIELDS:
        assert result[field] > 0, field
    assert result["chunk_mib"] == 0.125
    assert os.listdir(tmp_path) == []  # its temporary directory is gone


def test_bench_disk_runs_the_tier_with_a_codec(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    disk.add_arguments(parser)
    for codec, at_least in (("fp8", 1.9), ("lossless", 1.3)):
        argv = ["--chunks", "2", "--chunk-size", "4", "--repeats", "1", "--dir", str(tmp_path)]
        result = disk.run(parser.parse_args([*argv, "--codec", codec]))
        assert result["codec"] == codec and result["codec_ratio"] > at_least
        assert result["read_ratio"] > 0 and result["write_ratio"] > 0
