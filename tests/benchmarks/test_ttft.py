"""``python -m benchmarks ttft`` on a tiny model: every field is there and the arithmetic holds."""

from __future__ import annotations

import json

import pytest
from benchmarks.__main__ import main


def test_bench_ttft_json_fields(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["ttft", "--json", "--model-size", "tiny", "--prompt-tokens", "320"]
    assert main([*argv, "--chunk-size", "32", "--repeats", "1"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["cached_50_tokens"] == 160 and result["cached_90_tokens"] == 288
    for f in (50, 90):
        assert result[f"ttft_cached_{f}_ms"] > 0 and result[f"ttft_ideal_{f}_ms"] > 0
        speedup = result["ttft_full_ms"] / result[f"ttft_cached_{f}_ms"]
        # The bench rounds each figure to 3 decimals: within 1 % or that rounding, whichever is
        # more (a figure far below 1, on a loaded machine, is mostly rounding).
        assert result[f"speedup_{f}"] == pytest.approx(speedup, rel=1e-2, abs=5e-4)
        ratio = result[f"speedup_{f}"] / result[f"ideal_speedup_{f}"]
        assert result[f"efficiency_{f}"] == pytest.approx(ratio, rel=1e-2, abs=5e-4)
