"""Timing helpers shared by the benchmarks: best-of-N wall time, throughput in GB/s."""

from __future__ import annotations

import time
from collections.abc import Callable


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


def best_interleaved(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Best-of-N seconds for each function, running them in turn within every repeat, so a
    burst of load from other processes hits the baseline and the operation alike."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def gbps(nbytes: int, seconds: float) -> float:
    """Decimal gigabytes per second."""
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")
