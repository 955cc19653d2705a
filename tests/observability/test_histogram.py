"""The small histogram behind the latency and lease metrics."""

from __future__ import annotations

import math
import threading

import pytest

from kvtier.observability.histogram import Histogram


def test_buckets_are_cumulative_and_le_inclusive() -> None:
    hist = Histogram([0.1, 1.0, 10.0])
    for value in (0.05, 0.1, 0.5, 1.0, 20.0):
        hist.observe(value)
    snap = hist.snapshot()
    assert snap.buckets == ((0.1, 2), (1.0, 4), (10.0, 4), (math.inf, 5))
    assert snap.count == 5 and snap.total == pytest.approx(21.65)
    assert snap.quantile(0.5) == 1.0  # a ceiling: the bucket holding the median
    assert snap.quantile(0.99) == math.inf
    assert Histogram([1.0]).snapshot().quantile(0.5) == 0.0  # empty


def test_concurrent_observations_are_all_counted() -> None:
    hist = Histogram([1.0])

    def work() -> None:
        for _ in range(2000):
            hist.observe(0.5)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert hist.snapshot().count == 8000


@pytest.mark.parametrize("bounds", [[], [2.0, 1.0]])
def test_bounds_must_ascend(bounds: list[float]) -> None:
    with pytest.raises(ValueError, match="ascending"):
        Histogram(bounds)
