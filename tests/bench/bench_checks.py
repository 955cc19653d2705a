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
