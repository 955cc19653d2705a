"""kvtier's counters on vLLM's ``/metrics`` (vLLM's connector-stats path).

    worker   KVTierConnector.get_kv_connector_stats()  the Engine's counters since last step
    vLLM     adds them up over workers and steps, ships them to the API server process
    server   KVTierPromMetrics.observe()  ->  vllm:kvtier_* counters, labelled per engine

Counters (all ``_total`` in Prometheus): lookups, lookup_tokens, hit_tokens (loaded into
vLLM), found_tokens, unused_tokens (found, not needed), retrieved_tokens, stored_chunks,
dropped_chunks, load_failures. The Engine keeps its own
totals; the worker sends only the increase since its previous report, so vLLM's sums are
exact however often it asks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

COUNTERS = {
    "lookups": "Lookups kvtier answered",
    "lookup_tokens": "Prompt tokens kvtier was asked about",
    "hit_tokens": "Prompt tokens loaded from kvtier into vLLM (the hit)",
    "found_tokens": "Prompt tokens kvtier found at lookup",
    "unused_tokens": "Tokens kvtier found that vLLM did not need (its own prefix cache had them)",
    "retrieved_tokens": "Tokens loaded from kvtier into vLLM's KV cache",
    "stored_chunks": "Chunks stored into kvtier",
    "dropped_chunks": "Chunks not stored because every page was pinned",
    "load_failures": "Chunks that failed a checksum or vanished at load (recomputed)",
}


@dataclass
class KVTierStats(KVConnectorStats):
    """Counter increases; adding two is adding each counter."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merged = dict(self.data)
        for key, value in other.data.items():
            merged[key] = merged.get(key, 0) + value
        return KVTierStats(merged)

    def reduce(self) -> dict[str, int | float]:
        return {k: v for k, v in self.data.items() if isinstance(v, int | float)}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class CounterDeltas:
    """The increase of the Engine's counters since the previous call (worker side)."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}
        self._last_values: tuple[int, ...] = ()

    def take(self, totals: dict[str, Any]) -> dict[str, int]:
        now = {k: int(totals.get(k, 0)) for k in COUNTERS}
        delta = {k: v - self._last.get(k, 0) for k, v in now.items()}
        self._last = now
        self._last_values = tuple(now.values())
        return {k: v for k, v in delta.items() if v}

    def take_from(self, counters: object) -> dict[str, int]:
        """:meth:`take` reading the counters' attributes directly (vLLM asks every step;
        most steps change nothing, and then no dict is built)."""
        values = tuple(int(getattr(counters, k, 0)) for k in COUNTERS)
        if values == self._last_values:
            return {}
        return self.take(dict(zip(COUNTERS, values, strict=True)))


class KVTierPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters: dict[str, dict[int, PromMetric]] = {}
        transfer = vllm_config.kv_transfer_config
        if transfer is not None and (transfer.kv_connector_extra_config or {}).get("server"):
            # The cache is the host's kvtier server: its own /metrics has the figures (for
            # every instance); counters here would only ever read 0, so there are none.
            return
        for name, documentation in COUNTERS.items():
            metric = self._counter_cls(
                name=f"vllm:kvtier_{name}", documentation=documentation, labelnames=labelnames
            )
            self.counters[name] = create_metric_per_engine(metric, self.per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            per_engine = self.counters.get(name)
            if per_engine is not None and value > 0:
                per_engine[engine_idx].inc(value)  # type: ignore[union-attr]
