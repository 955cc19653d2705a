"""What a bench's JSON must get right whatever the host's speed: ratios that are the quotient
of the figures printed beside them, byte counts that add up. Never a timing."""

from __future__ import annotations

from typing import Any


def assert_ratio(data: dict[str, Any], ratio: str, over: str, under: str, places: int = 3) -> None:
    """``data[ratio]`` is ``data[over] / data[under]``, each rounded to ``places`` decimals
    (the bounds below take the rounding of all three into account, nothing more)."""
    half = 0.5 * 10**-places
    value, num, den = data[ratio], data[over], data[under]
    assert num > 0 and den > half, (over, num, under, den)
    low = (num - half) / (den + half) - half
    high = (num + half) / (den - half) + half
    assert low <= value <= high, f"{ratio}={value}, but {over}/{under} = {num}/{den}"


def assert_spread(
    data: dict[str, Any], ratio: str, over: str | None = None, under: str | None = None
) -> None:
    """``data[ratio]`` is a median of pairs with ``ratio_min <= ratio <= ratio_max``; with
    ``over`` / ``under`` (the medians of each side's runs), their quotient lies within that
    spread too (each run of the path is at most ``max`` and at least ``min`` times its pair's
    baseline rate, and a median keeps those bounds), allowing for the rounding to 3 places."""
    low, mid, high = data[f"{ratio}_min"], data[ratio], data[f"{ratio}_max"]
    assert 0 < low <= mid <= high, (ratio, low, mid, high)
    if over is not None and under is not None:
        half = 0.5e-3
        num, den = data[over], data[under]
        assert num > 0 and den > half, (over, num, under, den)
        assert (num - half) / (den + half) - half <= high, (ratio, num, den, high)
        assert (num + half) / (den - half) + half >= low, (ratio, num, den, low)
