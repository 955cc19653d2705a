"""The engine's open line says which reading each GB size got (issue 50, item 5): a bare
number is GiB (LMCache's reading), the string "5GB" decimal, 7 % less, and that must not pass
silently."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvtier import Engine
from tests.conftest import SMALL_CHUNK, SMALL_LAYOUT, small_config


def open_line(caplog: pytest.LogCaptureFixture, **overrides: object) -> str:
    config = small_config(**overrides)
    with (
        caplog.at_level(logging.INFO, logger="kvtier.engine"),
        Engine(config, SMALL_LAYOUT, model_name="m"),
    ):
        pass
    lines = [r.getMessage() for r in caplog.records if "kvtier engine open:" in r.getMessage()]
    assert len(lines) == 1, lines
    caplog.clear()
    return lines[0]


def test_the_open_line_says_a_bare_number_is_gib_and_a_gb_string_decimal(
    caplog: pytest.LogCaptureFixture,
) -> None:
    bare = open_line(caplog, max_local_cpu_size=0.001)  # ~1 MiB: 256 chunks of 4 KiB
    assert (
        "sizes: max_local_cpu_size 1.02 MiB (override: 0.001 as a bare number or '0.001GiB'; "
        "'0.001GB' would be 976.56 KiB)" in bare
    )
    decimal = open_line(caplog, max_local_cpu_size="0.001GB")
    assert (
        "sizes: max_local_cpu_size 976.56 KiB (override: '0.001GB' is decimal; a bare 0.001 "
        "would be 1.02 MiB)" in decimal
    )
    assert "tiers ['cpu']" in decimal  # the rest of the line is unchanged


def test_the_disk_size_is_named_with_a_disk_tier(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    line = open_line(caplog, local_disk=str(tmp_path), max_local_disk_size=1)
    assert "; max_local_disk_size 1.00 GiB (override: 1 as a bare number or '1GiB'" in line
    exact = open_line(caplog, cpu_chunks=4)  # bytes that are no whole GB either way
    size = 4 * SMALL_LAYOUT.chunk_bytes(SMALL_CHUNK)
    assert exact.endswith(f"sizes: max_local_cpu_size {size / 1024:.2f} KiB (override)")
