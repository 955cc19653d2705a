"""Prometheus metrics for one engine, read from its state at scrape time.

:func:`engine_registry` returns a ``CollectorRegistry`` holding one :class:`EngineCollector`.
The collector keeps no counts of its own: every scrape reads ``engine.stats()``, the tiers'
counters, the lease table (through ``stats``) and the engine's :class:`Observer` histograms,
so values are exact and nothing is counted twice. Two engines in one process get two
registries; nothing is registered globally.

Metric names follow Prometheus conventions (``kvtier_`` prefix, base units in the name,
``_total`` for counters); docs/operations.md lists them all. PD metrics appear when
``engine.stats()`` carries a ``"pd"`` mapping with the fields in :data:`PD_FIELDS`, or the
engine has a ``pd`` tier (the decoder's receive buffer), see :func:`pd_view`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvtier.errors import StateError
from kvtier.layout import KVLayout
from kvtier.lease import LeaseInfo
from kvtier.observability.histogram import HistogramSnapshot
from kvtier.observability.observer import Observer
from kvtier.storage.tenants.rows import metric_fields


class EngineView(Protocol):
    """What the metrics read of an engine (``kvtier.engine.Engine`` is one): the layer
    below the engine names what it reads instead of importing it."""

    @property
    def layout(self) -> KVLayout: ...

    @property
    def observer(self) -> Observer: ...

    def stats(self) -> dict[str, Any]: ...

    def leases(self) -> Sequence[LeaseInfo]: ...


# engine.stats() counter -> (metric name without _total, help)
ENGINE_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("requests", "kvtier_requests", "Requests ended (end_request that released a lease)."),
    ("lookups", "kvtier_lookups", "Lookups made."),
    ("lookup_tokens", "kvtier_lookup_requested_tokens", "Prompt tokens asked for by lookups."),
    (
        "hit_tokens",
        "kvtier_lookup_hit_tokens",
        "Prompt tokens loaded into the engine from kvtier (the hit; equals retrieved tokens).",
    ),
    (
        "found_tokens",
        "kvtier_lookup_found_tokens",
        "Prompt tokens lookups found in kvtier's tiers (beyond what the engine said it holds).",
    ),
    (
        "unused_tokens",
        "kvtier_found_unused_tokens",
        "Found tokens of ended requests that were never loaded (the engine, e.g. vLLM's own "
        "prefix cache, had them): found but not needed.",
    ),
    ("stores", "kvtier_stores", "Store calls."),
    ("stored_chunks", "kvtier_stored_chunks", "Chunks newly stored by store calls."),
    ("dropped_chunks", "kvtier_dropped_chunks", "Chunks a store dropped: every CPU page pinned."),
    ("retrieved_tokens", "kvtier_retrieved_tokens", "Tokens of KV copied out to the engine."),
    ("load_failures", "kvtier_load_failures", "Lower-tier chunks that failed to load at retrieve."),
)

# tier counter -> (metric name without _total, help); labelled by tier
TIER_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("stored", "kvtier_tier_stored_chunks", "Chunks written into the tier."),
    ("bytes_written", "kvtier_tier_stored_bytes", "Bytes written into the tier."),
    ("bytes_read", "kvtier_tier_read_bytes", "Bytes read from the tier by get_into."),
    ("hits", "kvtier_tier_get_hits", "get_into calls that found the chunk."),
    ("misses", "kvtier_tier_get_misses", "get_into calls that missed."),
    ("evicted", "kvtier_tier_evictions", "Entries evicted to make room."),
    ("dropped", "kvtier_tier_dropped_writes", "Writes the tier dropped (full or busy)."),
    ("failed", "kvtier_tier_failed_writes", "Writes that failed (I/O or server error)."),
    ("corrupt", "kvtier_tier_checksum_failures", "Entries that failed their checksum (removed)."),
)

# stats["pd"] field -> (metric, kind, help). Fields the PD code does not report are skipped.
PD_FIELDS: tuple[tuple[str, str, str, str], ...] = (
    ("buffer_used_bytes", "kvtier_pd_buffer_used_bytes", "gauge", "PD receive buffer in use."),
    ("buffer_capacity_bytes", "kvtier_pd_buffer_capacity_bytes", "gauge", "PD buffer size."),
    ("received_bytes", "kvtier_pd_received_bytes", "counter", "KV bytes received."),
    ("transfers", "kvtier_pd_transfers", "counter", "Request transfers completed."),
    ("failures", "kvtier_pd_transfer_failures", "counter", "Request transfers failed."),
    ("auth_failures", "kvtier_pd_auth_failures", "counter", "PD peers refused at the handshake."),
    ("timeouts", "kvtier_pd_timeouts", "counter", "PD connections closed at a deadline."),
    ("protocol_errors", "kvtier_pd_protocol_errors", "counter", "PD connections broken."),
    (
        "expired_reservations",
        "kvtier_pd_expired_reservations",
        "counter",
        "PD reservations freed unclaimed (pd_reservation_ttl_sec).",
    ),
)


def pd_view(stats: Mapping[str, Any]) -> dict[str, Any] | None:
    """The PD figures of ``stats``: its ``"pd"`` mapping when the PD code reports one, with
    the buffer occupancy and received bytes of the decoder's ``pd`` tier filled in where that
    tier exists. None when PD is not in use."""
    reported = stats.get("pd")
    tier = stats.get("tiers", {}).get("pd")
    if not isinstance(reported, Mapping) and tier is None:
        return None
    view: dict[str, Any] = {}
    if tier is not None:
        view["buffer_used_bytes"] = tier.get("used_bytes", 0)
        view["buffer_capacity_bytes"] = tier.get("capacity_bytes", 0)
        view["received_bytes"] = tier.get("bytes_written", 0)
        view["transfers"] = tier.get("transfers", 0)
        view["failures"] = tier.get("transfer_failures", 0)
        for name in ("auth_failures", "timeouts", "protocol_errors", "expired_reservations"):
            if name in tier:  # a receiver counts them (a buffer without one does not)
                view[name] = tier[name]
    if isinstance(reported, Mapping):
        view.update(reported)
    return view


def engine_registry(engine: EngineView) -> CollectorRegistry:
    """A registry with one collector reading ``engine`` at every scrape."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine))
    return registry


class EngineCollector(Collector):
    def __init__(self, engine: EngineView) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self.engine.stats()
            ages = [info.age_s for info in self.engine.leases()]
        except StateError:
            return  # not open (yet, or any more): nothing to report
        yield from _engine_counters(stats)
        yield from _tier_metrics(stats["tiers"], self.engine.layout.token_bytes(), stats)
        yield from _tenant_metrics(stats["tiers"])
        yield from _lease_metrics(stats, ages)
        yield from self._histograms()
        pd = pd_view(stats)
        if pd is not None:
            yield from _pd_metrics(pd)

    def _histograms(self) -> Iterator[Metric]:
        obs = self.engine.observer
        for op, hist in obs.latency.items():
            yield _histogram(
                f"kvtier_{op}_duration_seconds", f"Engine.{op} wall time.", hist.snapshot()
            )
        yield _histogram(
            "kvtier_lease_duration_seconds",
            "How long each ended request held its lease (lookup to end_request).",
            obs.lease_seconds.snapshot(),
        )
        yield _histogram(
            "kvtier_ttft_seconds",
            "Time to first token reported by the connector (record_ttft).",
            obs.ttft_seconds.snapshot(),
        )
        snap = obs.snapshot()
        hits = CounterMetricFamily(
            "kvtier_lookup_tier_hit_tokens",
            "Prompt tokens found by lookups, by the tier that held them (engine = skipped).",
            labels=["tier"],
        )
        for tier, tokens in sorted(snap["lookup_hit_tokens_by_tier"].items()):
            hits.add_metric([tier], tokens)
        yield hits
        yield GaugeMetricFamily(
            "kvtier_ttft_saved_seconds_estimate",
            "Hit tokens of reported requests x measured prefill seconds per computed token.",
            value=snap["ttft"]["saved_seconds_estimate"],
        )


# stats["tiers"][tier]["tenants"][tenant] field -> (metric, kind, help); labelled tier, tenant.
# Declared once, on the TenantRow fields (kvtier.storage.tenants.rows).
TENANT_FIELDS: tuple[tuple[str, str, str, str], ...] = tuple(metric_fields())


def _tenant_metrics(tiers: Mapping[str, Any]) -> Iterator[Metric]:
    """Per tenant and tier, with ``tenant_quotas`` set (no series otherwise); a tenant with
    no limit has no ``kvtier_tenant_limit_bytes`` series."""
    if not any("tenants" in t for t in tiers.values()):
        return
    for field, name, kind, doc in TENANT_FIELDS:
        family: GaugeMetricFamily | CounterMetricFamily
        if kind == "gauge":
            family = GaugeMetricFamily(name, doc, labels=["tier", "tenant"])
        else:
            family = CounterMetricFamily(name, doc, labels=["tier", "tenant"])
        for tier, values in sorted(tiers.items()):
            for tenant, row in sorted(values.get("tenants", {}).items()):
                if row.get(field) is not None:
                    family.add_metric([tier, tenant], row[field])
        yield family


def _engine_counters(stats: Mapping[str, Any]) -> Iterator[Metric]:
    for field, name, doc in ENGINE_COUNTERS:
        yield CounterMetricFamily(name, doc, value=stats.get(field, 0))
    loaded = CounterMetricFamily(
        "kvtier_loaded_tokens", "Tokens copied to the engine, by source tier.", labels=["tier"]
    )
    for tier, tokens in sorted(stats.get("hit_tokens_by_tier", {}).items()):
        loaded.add_metric([tier], tokens)
    yield loaded
    writes = CounterMetricFamily(
        "kvtier_tier_writes",
        "Lower-tier write completions, by outcome (stored, exists, dropped, failed).",
        labels=["tier", "outcome"],
    )
    for tier, outcomes in sorted(stats.get("writes_by_tier", {}).items()):
        for outcome, n in sorted(outcomes.items()):
            writes.add_metric([tier, outcome], n)
    yield writes


def _tier_metrics(
    tiers: Mapping[str, Mapping[str, int]], token_bytes: int, stats: Mapping[str, Any]
) -> Iterator[Metric]:
    for field, name, doc in TIER_COUNTERS:
        family = CounterMetricFamily(name, doc, labels=["tier"])
        for tier, counters in tiers.items():
            family.add_metric([tier], counters.get(field, 0))
        yield family
    retrieved = CounterMetricFamily(
        "kvtier_retrieved_bytes",
        "KV bytes served to the engine, by the tier they came from.",
        labels=["tier"],
    )
    for tier, tokens in sorted(stats.get("hit_tokens_by_tier", {}).items()):
        retrieved.add_metric([tier], tokens * token_bytes)
    yield retrieved
    for field, name, doc in (
        ("used_bytes", "kvtier_tier_used_bytes", "Bytes held by the tier's entries."),
        ("capacity_bytes", "kvtier_tier_capacity_bytes", "The tier's capacity in bytes."),
        ("entries", "kvtier_tier_entries", "Chunks held by the tier."),
    ):
        gauge = GaugeMetricFamily(name, doc, labels=["tier"])
        for tier, counters in tiers.items():
            gauge.add_metric([tier], counters.get(field, 0))
        yield gauge
    available = GaugeMetricFamily(
        "kvtier_tier_available",
        "1 while the tier serves; 0 while it is down (Redis unreachable, disk directory gone).",
        labels=["tier"],
    )
    for tier, counters in tiers.items():
        available.add_metric([tier], counters.get("available", 1))
    yield available


def _lease_metrics(stats: Mapping[str, Any], ages: list[float]) -> Iterator[Metric]:
    yield GaugeMetricFamily(
        "kvtier_open_leases", "Requests holding a lease now.", value=stats["open_requests"]
    )
    yield GaugeMetricFamily(
        "kvtier_pinned_bytes", "Bytes pinned by open requests.", value=stats["pinned_bytes"]
    )
    yield GaugeMetricFamily(
        "kvtier_pinned_chunks",
        "CPU chunk pages pinned by open requests.",
        value=stats["pinned_pages"],
    )
    yield GaugeMetricFamily(
        "kvtier_oldest_lease_age_seconds",
        "Age of the oldest open lease (0 when none).",
        value=max(ages, default=0.0),
    )
    alloc = stats["allocator"]
    yield GaugeMetricFamily(
        "kvtier_allocator_free_pages",
        "Free pages of the CPU block pool.",
        value=alloc["pages_free"],
    )
    yield GaugeMetricFamily(
        "kvtier_allocator_pages", "Pages of the CPU block pool.", value=alloc["pages_total"]
    )


def _pd_metrics(pd: Mapping[str, Any]) -> Iterator[Metric]:
    for field, name, kind, doc in PD_FIELDS:
        value = pd.get(field)
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if kind == "counter":
            yield CounterMetricFamily(name, doc, value=value)
        else:
            yield GaugeMetricFamily(name, doc, value=value)


def _histogram(name: str, doc: str, snap: HistogramSnapshot) -> Metric:
    buckets = [("+Inf" if math.isinf(b) else repr(b), n) for b, n in snap.buckets]
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=snap.total)
