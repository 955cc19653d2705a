"""The hooks the engine calls, feeding latency histograms, per-tier hit counts, lease
durations, reported TTFTs and the :class:`~kvtier.observability.explain.ExplainLog`.

Protocol: the engine creates one :class:`Observer` in its constructor (no threads, no I/O),
calls :meth:`attach` once its tiers exist (``open``), then on every request:

=====================  =======================================================================
engine call            observer hook
=====================  =======================================================================
``lookup``             :meth:`on_lookup` (latency, found tokens per tier, explain record);
                       returns the tokens found beyond those the engine holds
``retrieve[_into]``    ``with`` :meth:`load` ``as load: load.end = ...``: one record per
                       load (latency, tokens loaded per tier, checksum failures for explain);
                       ``load.copied`` is the tokens copied into the engine
``store``              :meth:`on_store` (latency, which keys were stored or dropped)
``end_request``        :meth:`on_request_end` (how long the lease was held, the request's log
                       line); returns the tokens found for the request and never loaded
``record_ttft``        :meth:`record_ttft` (a connector reports the time to first token)
=====================  =======================================================================

What one request found and loaded is kept on its lease (:class:`~kvtier.lease.RequestRecord`),
not here: it ends with the request. Readers (the Prometheus collector, the admin API) only
read; hooks never raise into the engine for an observability problem.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence, Sized
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.errors import ConfigError, KVTierError
from kvtier.fingerprint import Fingerprint
from kvtier.keys import ChunkKey, ChunkSpan
from kvtier.observability.explain import ExplainLog
from kvtier.observability.histogram import LATENCY_BUCKETS, LEASE_BUCKETS, Histogram
from kvtier.observability.logs import log_request_end
from kvtier.storage.lookup import ENGINE

if TYPE_CHECKING:
    from kvtier.config import Config
    from kvtier.lease import Lease, RequestRecord
    from kvtier.storage.base import Tier
    from kvtier.storage.lookup import LookupPlan
    from kvtier.storage.manager import StorageManager

log = logging.getLogger(__name__)

OPERATIONS = ("lookup", "store", "retrieve")
DEFAULT_EXPLAIN_REQUESTS = 1000


@dataclass
class Load:
    """One load of a request's hit: the caller sets ``end`` (the end of the loaded prefix)."""

    start: int
    end: int = 0

    @property
    def copied(self) -> int:
        """Tokens copied into the engine by this load (the hit it served)."""
        return max(0, self.end - self.start)


@dataclass
class TtftTotals:
    """Sums over the TTFTs a connector reported (see :meth:`Observer.record_ttft`)."""

    requests: int = 0
    seconds: float = 0.0
    computed_tokens: int = 0  # prompt tokens prefilled (not served from the cache)
    hit_tokens: int = 0

    @property
    def seconds_per_token(self) -> float:
        return self.seconds / self.computed_tokens if self.computed_tokens else 0.0

    @property
    def saved_seconds_estimate(self) -> float:
        """Hit tokens times the measured prefill cost per computed token: what prefilling
        the cached tokens would have added. An estimate (prefill is not exactly linear)."""
        return self.hit_tokens * self.seconds_per_token


class Observer:
    def __init__(self, fingerprint: Fingerprint, config: Config) -> None:
        capacity = _explain_capacity(config.extra_config)
        self.explain = ExplainLog(
            fingerprint, save_unfull_chunk=config.save_unfull_chunk, capacity=capacity
        )
        self.latency = {op: Histogram(LATENCY_BUCKETS) for op in OPERATIONS}
        self.lease_seconds = Histogram(LEASE_BUCKETS)
        self.ttft_seconds = Histogram(LATENCY_BUCKETS)
        self.ttft = TtftTotals()
        self.lookup_hit_tokens: Counter[str] = Counter()  # tier -> tokens found by lookups
        self._manager: StorageManager | None = None
        self._lock = threading.Lock()

    def attach(self, manager: StorageManager) -> None:
        """Called by ``Engine.open`` once the tiers exist: subscribe to eviction reports, and
        tell explain which tiers can lose a chunk without one."""
        self._manager = manager
        # The cache tiers below the CPU one (pd and p2p keep no stores: no KV events either).
        lower = [t for t in manager.tiers[1:] if t.accepts_puts and t.medium is not None]
        shared = [t.name for t in lower if t.medium == "REMOTE"]  # Redis, S3
        self.explain.describe_tiers(lower=[t.name for t in lower], shared=shared)
        for tier in manager.tiers:
            tier.add_evict_listener(_evict_reporter(self.explain, tier))

    # -- hooks -----------------------------------------------------------------------------
    def on_lookup(
        self,
        lease: Lease[Any],
        tokens: object,
        spans: Sequence[ChunkSpan],
        plan: LookupPlan,
        started: float,
        keyed_by: str = "",
    ) -> int:
        """Record a lookup (``keyed_by``: what besides tokens keys it, for explain); return
        the tokens it found in kvtier's tiers (chunks inside ``skip_leading_tokens``, which
        the engine holds already, are not counted)."""
        # Runs of chunks per tier, not chunks: a long cached prompt is one run.
        by_tier: dict[str, int] = {}
        size = plan.spans.chunk_size
        found = 0
        for tier, first, end in plan.runs:
            tokens_hit = plan.spans.end(end - 1) - (plan.spans.first + first) * size
            by_tier[tier.name] = by_tier.get(tier.name, 0) + tokens_hit
            if tier is not ENGINE:  # held by the caller already: not found in a tier
                found += tokens_hit
        runs = [(tier.name, first, end) for tier, first, end in plan.runs]
        with self._lock:
            for name, tokens_hit in by_tier.items():
                self.lookup_hit_tokens[name] += tokens_hit
        _guarded(
            self.explain.record_lookup,
            lease.request_id,
            tokens,
            plan.spans,
            runs,
            found,
            self._probe,
            keyed_by,
        )
        prompt = len(tokens) if isinstance(tokens, Sized) else plan.spans.num_tokens
        lease.record.note_found(prompt, found)
        self.latency["lookup"].observe(time.perf_counter() - started)
        return found

    @contextmanager
    def load(
        self, lease: Lease[Any], plan: LookupPlan, start: int, started: float
    ) -> Iterator[Load]:
        """``with observer.load(lease, plan, start, started) as load: load.end = ...``: the
        request's hit from ``start`` is copied into the engine in the block. One record at
        its end: tokens loaded per tier (on the lease), a short load's first failed chunk
        for explain (checksum failure or lost), the retrieve's latency since ``started``. A
        load that raises records nothing."""
        hits = [(h.span, h.tier.name) for h in plan.hits]  # as planned: a load may cut them
        corrupt_before = self._corrupt_counts()
        load = Load(start)
        yield load
        end = load.end
        by_tier: dict[str, int] = {}
        for hit in plan.hits:
            if hit.tier is ENGINE:
                continue
            overlap = min(hit.span.end, end) - max(hit.span.start, start)
            if overlap > 0:
                by_tier[hit.tier.name] = by_tier.get(hit.tier.name, 0) + overlap
        lease.record.note_loaded(load.copied, by_tier)
        rose: set[str] = set()
        if hits and hits[-1][0].end > end:
            now = self._corrupt_counts()
            rose = {t for t, n in now.items() if n > corrupt_before.get(t, 0)}
        request = lease.request_id
        _guarded(self.explain.record_load, request, hits, end, rose, self._corruption, load.copied)
        self.latency["retrieve"].observe(time.perf_counter() - started)

    def on_store(
        self, tokens: object, spans: Sequence[ChunkSpan], dropped: int, started: float
    ) -> None:
        _guarded(self.explain.note_store, tokens, spans, min(dropped, len(spans)))
        self.latency["store"].observe(time.perf_counter() - started)

    def on_request_end(self, lease: Lease[Any]) -> int:
        """The request ended: observe its lease's duration and write its log line; return
        the tokens its lookup found that were never loaded (the engine had them already, or
        never asked)."""
        self.lease_seconds.observe(time.monotonic() - lease.created)
        record: RequestRecord = lease.record
        _guarded(self.explain.record_end, lease.request_id, record.unused)
        log_request_end(lease.request_id, record)
        return record.unused

    def record_ttft(self, seconds: float, *, prompt_tokens: int, hit_tokens: int) -> None:
        """A connector reports one request's time to first token, its prompt length and how
        many of those tokens came from the cache (checked by the cache's ``record_ttft``)."""
        self.ttft_seconds.observe(seconds)
        with self._lock:
            self.ttft.requests += 1
            self.ttft.seconds += seconds
            self.ttft.computed_tokens += prompt_tokens - hit_tokens
            self.ttft.hit_tokens += hit_tokens

    # -- reading ---------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """JSON-ready: latency quantile ceilings, per-tier lookup hits, TTFT totals."""
        latency = {}
        for op, hist in self.latency.items():
            snap = hist.snapshot()
            latency[op] = {
                "count": snap.count,
                "sum_s": snap.total,
                # Bucket ceilings; None when the value is past the last bound (+Inf).
                "p50_le_s": _finite(snap.quantile(0.5)),
                "p99_le_s": _finite(snap.quantile(0.99)),
            }
        with self._lock:
            ttft = TtftTotals(**vars(self.ttft))
            hits = dict(self.lookup_hit_tokens)
        return {
            "latency": latency,
            "lookup_hit_tokens_by_tier": hits,
            "ttft": {
                "reported_requests": ttft.requests,
                "seconds_total": ttft.seconds,
                "prefill_seconds_per_token": ttft.seconds_per_token,
                "saved_seconds_estimate": ttft.saved_seconds_estimate,
            },
            "explain_records": len(self.explain),
        }

    def _probe(self, keys: Sequence[ChunkKey]) -> list[str | None]:
        """Which tier holds each key now: one batched contains per tier, CPU first."""
        manager = self._manager
        where: list[str | None] = [None] * len(keys)
        if manager is None:
            return where
        tiers = manager.tiers if manager.cpu_visible else manager.lower
        for tier in tiers:
            todo = [i for i, w in enumerate(where) if w is None]
            if not todo:
                break
            try:
                answers = tier.contains([keys[i] for i in todo])
            except KVTierError:
                continue  # an unreachable tier explains nothing; the lookup already warned
            for i, present in zip(todo, answers, strict=True):
                if present:
                    where[i] = tier.name
        return where

    def _corruption(self, tier: str, key: ChunkKey) -> str | None:
        """Why ``tier`` last found ``key`` corrupt (e.g. the KV-cache group that differed)."""
        manager = self._manager
        for t in manager.lower if manager is not None else ():
            if t.name == tier:
                return t.corruption(key)
        return None

    def _corrupt_counts(self) -> dict[str, int]:
        manager = self._manager
        return {t.name: t.counters.corrupt for t in manager.lower} if manager is not None else {}


def _guarded(fn: Callable[..., None], *args: Any) -> None:
    """Run an explain hook; a failure there is logged, never raised into a request."""
    try:
        fn(*args)
    except Exception:
        log.exception("kvtier explain hook %s failed; the request is unaffected", fn.__name__)


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _evict_reporter(log: ExplainLog, tier: Tier) -> Any:
    name = tier.name

    def report(keys: Sequence[ChunkKey]) -> None:
        tenants = tier.tenants  # tenant_quotas: key -> its tenant
        by_quota = tenants.evicted_by_quota(keys) if tenants is not None else {}
        if by_quota:
            log.note_quota_evicted(name, by_quota)
            keys = [k for k in keys if k not in by_quota]
        log.note_evicted(name, keys)

    return report


def _explain_capacity(extra: dict[str, Any]) -> int:
    value = extra.get("explain_requests", DEFAULT_EXPLAIN_REQUESTS)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1_000_000:
        raise ConfigError(
            "extra_config.explain_requests", value, "an int in [0, 1000000] (0 turns explain off)"
        )
    return value
