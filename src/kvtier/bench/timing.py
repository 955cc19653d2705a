"""Timing shared by the benchmarks: a path and its baseline run in alternating pairs, and the
median ratio of the pairs with its spread.

Why pairs: on a shared host the baseline itself moves between runs (memcpy measured 24 GB/s
in one run and 34 in the next here), and every best-of-N ratio moved with it. Run back to
back, a path and its baseline see the same load, so the ratio *of one pair* holds while the
absolute figures swing; the median of the pairs' ratios drops the pairs a burst hit one side
of, and the spread (lowest and highest pair) says how much the host disturbed the figure.

The protocol of :func:`alternate`:

    warm-up:  A B                 (each once, untimed: first-touch, lazy imports, caches)
    round 0:  A B                 pair 0 = (A0, B0)
    round 1:  B A                 pair 1 = (A1, B1)   the order flips every round, so what
    round 2:  A B                 ...                 runs second (a warm cache, a core left
                                                      spinning by the one before) favours
                                                      neither side
    ratio of round i = baseline_seconds[i] / path_seconds[i]   (same bytes: a rate ratio)

A baseline given as several names (memcpy on one and on two threads) counts, in each round,
its fastest name: the best way the baseline moves these bytes at that moment.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass


def best_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """The fastest of ``repeats`` runs of ``fn`` after ``warmup`` runs (the least disturbed by
    other work on a shared machine; the baseline is measured the same way)."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


@dataclass(frozen=True)
class Spread:
    """The ratios of ``pairs`` pairs: their median, lowest and highest."""

    median: float
    low: float
    high: float
    pairs: int

    def fields(self, name: str, places: int | None = 3) -> dict[str, float]:
        """``{name: median, name_min: low, name_max: high}``, rounded to ``places``
        (``None``: unrounded) for a bench's JSON."""

        def shown(value: float) -> float:
            return value if places is None else round(value, places)

        return {
            name: shown(self.median),
            f"{name}_min": shown(self.low),
            f"{name}_max": shown(self.high),
        }


def spread(path_seconds: Sequence[float], base_seconds: Sequence[float]) -> Spread:
    """The pairs' rate ratios ``base_seconds[i] / path_seconds[i]`` (the same bytes each)."""
    if not path_seconds or len(path_seconds) != len(base_seconds):
        raise ValueError(f"pairs: {len(path_seconds)} path runs, {len(base_seconds)} baseline")
    ratios = [base / path for path, base in zip(path_seconds, base_seconds, strict=True)]
    return Spread(statistics.median(ratios), min(ratios), max(ratios), len(ratios))


@dataclass(frozen=True)
class Rounds:
    """Seconds of every timed run, by name, one entry per round (see the module docstring)."""

    seconds: dict[str, list[float]]

    def best(self, name: str) -> float:
        return min(self.seconds[name])

    def median(self, name: str | Sequence[str]) -> float:
        """Median seconds of ``name`` (of several names: of each round's fastest)."""
        return statistics.median(self.per_round(name))

    def gbps(self, name: str | Sequence[str], nbytes: int) -> float:
        """``nbytes`` over the median seconds of ``name``: decimal GB/s."""
        return gbps(nbytes, self.median(name))

    def ratio(self, path: str, baseline: str | Sequence[str]) -> Spread:
        """Rate of ``path`` over rate of ``baseline`` in each round, as a :class:`Spread`."""
        return spread(self.seconds[path], self.per_round(baseline))

    def per_round(self, name: str | Sequence[str]) -> list[float]:
        """Seconds of ``name`` in each round (of several names: each round's fastest)."""
        names = [name] if isinstance(name, str) else list(name)
        return [min(run) for run in zip(*(self.seconds[n] for n in names), strict=True)]


def alternate(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 1) -> Rounds:
    """Run every function once per round for ``repeats`` rounds, in the given order in even
    rounds and in reverse in odd ones, after ``warmup`` untimed rounds."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    seconds: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns.items())
    for i in range(repeats):
        for name, fn in order if i % 2 == 0 else reversed(order):
            start = time.perf_counter()
            fn()
            seconds[name].append(time.perf_counter() - start)
    return Rounds(seconds)


def best_interleaved(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Best-of-N seconds for each function, run in alternating rounds (:func:`alternate`)."""
    rounds = alternate(fns, repeats)
    return {name: rounds.best(name) for name in fns}


def host_load() -> dict[str, float | int]:
    """The host's 1-minute load average and its core count, recorded beside each figure
    (what else ran while it was measured)."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return {"load_1m": round(load, 2), "cpus": os.cpu_count() or 0}


def gbps(nbytes: int, seconds: float) -> float:
    """Decimal gigabytes per second."""
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")
