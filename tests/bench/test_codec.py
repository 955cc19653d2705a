"""``kvtier bench codec``: every codec's ratio and speed against memcpy in the same run, the
lossy codecs' error, and the quality gate's hook."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from kvtier.bench import codec as bench
from kvtier.cli.bench import BENCHMARKS


def run(*argv: str) -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return bench.run(parser.parse_args(["--repeat", "1", *argv]))


def test_every_codec_is_measured_on_bf16_and_fp32_against_memcpy() -> None:
    assert "codec" in BENCHMARKS
    result = run("--no-gate")
    assert result["threads"] == 1
    for dtype, lossless_at_least in (("bf16", 1.3), ("fp32", 1.1)):
        rows = result[dtype]["codecs"]
        assert set(rows) == {"identity", "lossless", "fp8", "int8"}
        assert result[dtype]["memcpy_gbps"] > 0
        assert rows["identity"]["ratio"] == 1.0 and rows["identity"]["encode_gbps"] is None
        assert rows["lossless"]["ratio"] > lossless_at_least
        for name in ("fp8", "int8"):
            row = rows[name]
            assert row["ratio"] > (1.9 if dtype == "bf16" else 3.8)
            assert row["key_rel_error"] < 0.03 and row["value_rel_error"] < 0.03
            assert row["encode_of_memcpy"] == pytest.approx(
                row["encode_gbps"] / result[dtype]["memcpy_gbps"]
            )
        assert all(row["gate"] is None for row in rows.values())  # --no-gate
