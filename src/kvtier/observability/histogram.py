"""A small thread-safe histogram: fixed bucket bounds, cumulative counts on read.

The engine observes into these on its hot path (one lock, one bisect), and the Prometheus
collector reads them at scrape time, so there is no global registry and no double counting.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass

# Seconds: 50 µs .. 60 s, enough for a CPU hit (tens of µs) and a slow remote read.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    60.0,
)
# Seconds a request held its lease: 1 ms .. 1 h.
LEASE_BUCKETS: tuple[float, ...] = (
    0.001,
    0.01,
    0.1,
    0.5,
    1.0,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
    900.0,
    3600.0,
)


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    """Cumulative counts per upper bound (the last bound is +Inf), the sum and the count."""

    buckets: tuple[tuple[float, int], ...]
    total: float
    count: int

    def quantile(self, q: float) -> float:
        """Upper bound of the bucket holding quantile ``q`` (0 when empty): a ceiling."""
        if self.count == 0:
            return 0.0
        rank = q * self.count
        for bound, cumulative in self.buckets:
            if cumulative >= rank:
                return bound
        return math.inf


class Histogram:
    def __init__(self, bounds: Sequence[float]) -> None:
        if list(bounds) != sorted(bounds) or not bounds:
            raise ValueError("histogram bounds must be a non-empty ascending sequence")
        self.bounds = tuple(bounds)
        self._counts = [0] * (len(self.bounds) + 1)  # the last slot is +Inf
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        # bisect_left: a value equal to a bound belongs to that bound's bucket (le = "<=").
        slot = bisect.bisect_left(self.bounds, value)
        with self._lock:
            self._counts[slot] += 1
            self._sum += value

    def snapshot(self) -> HistogramSnapshot:
        with self._lock:
            counts = list(self._counts)
            total = self._sum
        cumulative: list[tuple[float, int]] = []
        running = 0
        for bound, n in zip((*self.bounds, math.inf), counts, strict=True):
            running += n
            cumulative.append((bound, running))
        return HistogramSnapshot(tuple(cumulative), total, running)
