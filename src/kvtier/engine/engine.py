"""The public entry point: :class:`Engine`, the cache surface (:class:`kvtier.cache.KVCache`:
lookup, retrieve, store, end_request; its arguments checked there) over this process's tiers.

Every reference a request takes lives in its lease (:mod:`kvtier.lease`) until
``end_request``. Call it on every path that ends a request (finished, aborted, failed, timed
out): a ``try/finally`` in the caller, or ``with engine.request(rid):`` that does it for you.

A request's steps (its keys, lookup, plan, load and end) are :mod:`kvtier.engine._core`'s,
shared with the page view. Two narrower faces are views in their own modules:
``engine.pages()`` (:mod:`kvtier.engine._pages`, for a process that maps the page buffer) and
``engine.receiver_host()`` (:mod:`kvtier.pd.host`, for a decoder's PD receiver). Which tiers
exist is the config's business (:mod:`kvtier.tiers`); the engine opens what it is given.
"""

from __future__ import annotations

import logging
import mmap
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Self, Unpack

import numpy as np
import torch

from kvtier.cache import CacheIdentity, KVCache
from kvtier.config import Config
from kvtier.config.sizes import size_notes
from kvtier.engine._core import EngineCore, OpenParts
from kvtier.engine._pages import EnginePages
from kvtier.errors import StateError
from kvtier.hit import Hit
from kvtier.keys import RequestKeys
from kvtier.layout import KVLayout
from kvtier.lease import Lease, LeaseInfo, LeaseTable, RequestRecord
from kvtier.lifecycle import Lifecycle, guarded
from kvtier.memory.device import CopyEngine, DeviceCopies
from kvtier.observability.observer import Observer
from kvtier.observability.stats import engine_stats
from kvtier.pd.host import EngineReceiverHost
from kvtier.request_salt import RequestSalt, tenant_of
from kvtier.storage.audit import audit_references
from kvtier.storage.base import Tier
from kvtier.storage.counters import EngineCounters
from kvtier.storage.lookup import ENGINE, LookupPlan
from kvtier.storage.manager import StorageManager
from kvtier.storage.tenants.quotas import TenantQuotas
from kvtier.tiers import check_tier_urls, clear_tiers, cpu_pages, given_lower_tiers, open_storage
from kvtier.validation import Prompt, check_fits_in_memory, check_out

log = logging.getLogger(__name__)


EngineState = Lifecycle  # the public name of the engine's lifecycle states

_guarded = guarded  # a public call: counted in flight, refused once close has begun


class Engine(KVCache):
    """A tiered KV cache for one model (one tensor-parallel rank).

    Construction validates and sizes everything but allocates nothing and starts no thread;
    :meth:`open` (or ``with Engine(...) as engine``) does. :meth:`close` is idempotent.
    """

    def __init__(
        self,
        config: Config | None,
        layout: KVLayout,
        *,
        page_memory: Callable[[int], mmap.mmap] | None = None,
        lower_tiers: Sequence[Tier] | None = None,
        copies: CopyEngine | None = None,
        **identity: Unpack[CacheIdentity],
    ) -> None:
        """``identity``: ``model_name`` (required), ``tp_rank``, ``tp_world_size``
        (:class:`kvtier.cache.CacheIdentity`).

        ``page_memory(nbytes)`` makes the memory of the CPU page buffer (the kvtier server
        passes shared memory that its clients map); by default it is anonymous memory.

        ``lower_tiers``: ready-made tiers below CPU, unopened, in search order, used instead
        of those the config's tier keys name (tests, embeddings); the engine opens them at
        :meth:`open` and closes them at :meth:`close`, as it does the tiers it builds.

        ``copies``: the owner of every copy between a device tensor and the pages
        (:class:`kvtier.memory.device.DeviceCopies` by default)."""
        super().__init__(config, layout, **identity)
        if lower_tiers is None:
            check_tier_urls(self.config)  # a scheme no tier is registered for: ConfigError
        else:
            lower_tiers = given_lower_tiers(lower_tiers)
        self._lower_tiers = lower_tiers
        self.num_pages = cpu_pages(self.config, layout)  # staging pages only with a cpu_codec
        check_fits_in_memory("max_local_cpu_size", self.config.max_local_cpu_size)
        self.counters = EngineCounters()
        self.observer = Observer(self.fingerprint, self.config)  # metrics, explain (no I/O)
        # What this engine and its page view share (kvtier.engine._core): the call guard,
        # the parts that exist while open, a request's keys and its end.
        self._core = EngineCore(self.config, self.keychain, self.counters, self.observer)
        self._guard = self._core.guard  # the state, and the public calls in flight
        self._state_lock = threading.Lock()  # one open() or close() at a time
        self._page_memory = page_memory
        self._copies = copies if copies is not None else DeviceCopies()

    # -- lifecycle -------------------------------------------------------------------------
    def open(self) -> Self:
        with self._state_lock:
            if self._guard.state is EngineState.OPEN:
                return self
            if self._guard.state is EngineState.CLOSED:
                raise StateError("this Engine is closed; create a new one")
            manager = open_storage(
                self.config,
                self.layout,
                self.fingerprint,
                self.num_pages,
                self.counters,
                self._page_memory,
                self._lower_tiers,
                self._copies,
            )
            leases = LeaseTable[LookupPlan](manager.pool)
            self._core.attach(OpenParts(manager, leases, manager.pool))
            self.observer.attach(manager)
            self._guard.open()
            log.info(
                "kvtier engine open: %s, %d CPU pages of %d bytes, tiers %s; sizes: %s",
                self.layout.describe(),
                self.num_pages,
                self.chunk_bytes,
                [t.name for t in manager.tiers],
                # A bare 5 is GiB and "5GB" decimal (7 % less): say which one each size got.
                size_notes(self.config),
            )
            return self

    def close(self) -> None:
        """Refuse new calls (StateError), wait for the calls in flight (up to
        ``blocking_timeout_secs``, which bounds each tier operation), end every open request,
        drain in-flight writes, close tiers, free memory."""
        with self._state_lock:
            was_open = self._guard.state is EngineState.OPEN
            bound = self.config.blocking_timeout_secs
            if not self._guard.close(bound if was_open else 0.0):
                log.warning(
                    "closing with %d calls still running after %.1fs; they end with StateError",
                    self._guard.running,
                    bound,
                )
            parts = self._core.detach()
            if not was_open or parts is None:
                return
        still_open = parts.leases.end_all()
        if still_open:
            log.warning(
                "closing with %d requests still open; their leases were released", still_open
            )
        try:
            parts.manager.flush(self.config.blocking_timeout_secs)
            parts.manager.close()
        finally:
            parts.pool.close()

    @property
    def state(self) -> EngineState:
        return self._guard.state

    def _open_parts(self) -> tuple[StorageManager, LeaseTable[LookupPlan]]:
        parts = self._core.parts()
        return parts.manager, parts.leases

    def _call(self) -> AbstractContextManager[None]:
        """A call counted in flight (see ``_guarded``): every public call of the cache
        surface."""
        return self._core.call()

    # -- the request API (KVCache's hooks: the arguments are checked) ----------------------
    def _lookup(self, request_id: str, prompt: Prompt) -> Hit:
        return self._core.lookup(request_id, prompt)

    def _retrieve(self, request_id: str, prompt: Prompt) -> torch.Tensor:
        """After ``lookup(..., skip_leading_tokens=N)`` the first N tokens' chunks were never
        looked up; they are looked up and loaded now, and when the cache does not hold them
        all this raises :class:`InputError`: use :meth:`retrieve_into` with the same skip."""
        started = time.perf_counter()
        core = self._core
        plan = core.plan(request_id, prompt)
        if plan.hits and plan.hits[0].tier is ENGINE:
            core.locate_skipped(plan, request_id)
        out = torch.empty(self.layout.kv_shape(plan.hit_tokens), dtype=self.layout.dtype)
        loaded = core.load(plan, request_id, out, 0, started)
        return out[:, :, :loaded, :]

    def _retrieve_into(self, request_id: str, prompt: Prompt, out: torch.Tensor) -> int:
        started = time.perf_counter()
        core = self._core
        plan = core.plan(request_id, prompt)
        check_out(out, self.layout, plan.hit_tokens - prompt.base)
        start = (prompt.skip // self.config.chunk_size) * self.config.chunk_size
        return core.load(plan, request_id, out, start, started, prompt.base)

    def _store(self, prompt: Prompt, kv: torch.Tensor, keys: RequestKeys | None) -> int:
        started = time.perf_counter()
        manager, _ = self._open_parts()
        array = prompt.tokens
        spans = (keys if keys is not None else self._keys_for(array, prompt.salt, None)).spans
        self.counters.add(stores=1)
        offered = spans[prompt.skip // self.config.chunk_size :]
        stored, dropped = manager.store(offered, kv, tenant_of(prompt.salt), prompt.base)
        self.observer.on_store(array, offered, dropped, started)
        return stored

    def _end_request(self, request_id: str) -> bool:
        return self._core.end_request(request_id)

    def request_record(self, request_id: str) -> RequestRecord | None:
        """What ``request_id``'s lease recorded so far (its lookup, loads and stores), or None
        when it holds none: the kvtier server sends it with the end, so that the engine
        process logs the request's line as an in-process engine does."""
        _, leases = self._open_parts()
        lease = leases.get(request_id)
        return lease.record if lease is not None else None

    def record_stored(self, request_id: str, tokens: int, prompt_tokens: int) -> None:
        """``tokens`` of ``request_id``'s prompt were newly stored (for its log line): a
        connector that knows which request a store is for says so (:meth:`store` takes no
        request id). Nothing is kept for a request that holds no lease."""
        _, leases = self._open_parts()
        lease = leases.get(request_id)
        if lease is not None:
            lease.record.note_stored(tokens, prompt_tokens)

    def _record_ttft(self, seconds: float, prompt_tokens: int, hit_tokens: int) -> None:
        """For the TTFT metrics and the dashboard's TTFT-saved estimate (see
        kvtier.observability.observer)."""
        self.observer.record_ttft(seconds, prompt_tokens=prompt_tokens, hit_tokens=hit_tokens)

    # -- inspection ------------------------------------------------------------------------
    @_guarded
    def stats(self) -> dict[str, Any]:
        """Counts, gauges and every tier's usage and counters, as one plain dict (the
        admin API, the metrics and the demo read it; :mod:`kvtier.observability.stats`)."""
        manager, leases = self._open_parts()
        return engine_stats(manager, leases, self.counters)

    @_guarded
    def leases(self) -> list[LeaseInfo]:
        """Every open request: what it holds and for how long (the admin API's /leases)."""
        _, leases = self._open_parts()
        return leases.snapshot()

    @_guarded
    def leaks(self) -> list[LeaseInfo]:
        """Every request still holding something, with what and for how long."""
        _, leases = self._open_parts()
        return [info for info in leases.snapshot() if info.pinned_pages or info.holds]

    @_guarded
    def check_invariants(self) -> list[str]:
        """Problems with reference counts, as sentences; empty when all is well.

        Every reference has an owner (a CPU cache entry, a request lease, or a lower-tier write
        still in flight); with no request open, none is left over. After :meth:`flush` and
        with no request open, every page is free or owned by exactly one cache entry.
        """
        manager, leases = self._open_parts()
        problems = audit_references(manager, leases)
        for tier in manager.lower:
            problems.extend(tier.audit(leases))
        return problems

    @_guarded
    def clear(self) -> dict[str, int]:
        """Drop every unpinned entry of every tier (pinned ones stay); tier -> entries dropped.
        Lower-tier writes already queued land first (up to ``blocking_timeout_secs``), so
        none of them brings back a chunk stored before the clear. A tier that fails is
        skipped, the others are cleared, then :class:`TierError` names it."""
        manager, _ = self._open_parts()
        manager.flush(self.config.blocking_timeout_secs)
        return clear_tiers(manager.tiers)

    @_guarded
    def flush(self, timeout: float | None = None) -> bool:
        """Wait for in-flight lower-tier writes. True when all landed."""
        manager, _ = self._open_parts()
        return manager.flush(timeout)

    @_guarded
    def tier(self, name: str) -> Tier | None:
        """The open tier called ``name`` (``"cpu"``, ``"disk"``, ``"pd"``, ...), or None."""
        manager, _ = self._open_parts()
        return next((t for t in manager.tiers if t.name == name), None)

    @_guarded
    def quotas(self) -> TenantQuotas | None:
        """The engine's one quota table (``tenant_quotas``), which every tier's ledger reads
        and ``PUT /quota`` edits; None when quotas are off."""
        manager, _ = self._open_parts()
        return manager.quotas

    @_guarded
    def tiers(self) -> list[Tier]:
        """The open tiers in search order: cpu, then the lower tiers."""
        manager, _ = self._open_parts()
        return list(manager.tiers)

    # -- views ---------------------------------------------------------------------------------
    def pages(self) -> EnginePages:
        """The page API, for a process that maps the page buffer (:mod:`kvtier.engine._pages`)."""
        return EnginePages(self._core)

    def receiver_host(self) -> EngineReceiverHost:
        """This engine as a PD receiver sees it (:mod:`kvtier.pd.host`); needs an open engine."""
        manager, leases = self._open_parts()
        return EngineReceiverHost(self.config, self.fingerprint, manager.lower, leases, self._guard)

    # -- helpers ---------------------------------------------------------------------------
    def _request_keys(
        self, tokens: np.ndarray, salt: RequestSalt | None, request_id: str | None
    ) -> RequestKeys:
        """What the request's lookup hashed is reused (a request is hashed once); without a
        request id, or for one with no lease, they are hashed."""
        _, leases = self._open_parts()
        lease = leases.get(request_id) if request_id is not None else None
        return self._keys_for(tokens, salt, lease)

    def _keys_for(
        self, tokens: np.ndarray, salt: RequestSalt | None, lease: Lease[LookupPlan] | None
    ) -> RequestKeys:
        return self._core.keys_for(tokens, salt, lease)

    @contextmanager
    def loading(self, request_id: str) -> Iterator[bool]:
        """Inside the block an :meth:`end_request` of ``rid`` (from another thread) returns
        at once and releases the lease when the block exits: the pages the load reads stay
        pinned until its last byte is copied."""
        _, leases = self._open_parts()
        lease = leases.begin_busy(request_id)
        try:
            yield lease is not None
        finally:
            if lease is not None:
                leases.end_busy(lease)
