"""The public entry point: :class:`Engine`.

Who calls what::

    engine.lookup(tokens, request_id)       -> hit tokens; pins the hit prefix in the lease
    engine.retrieve(tokens, request_id)     -> KV of the hit prefix (loads lower-tier chunks)
    engine.store(tokens, kv)                -> stores the chunks not yet held (never blocks)
    engine.end_request(request_id)          -> releases everything the request holds; again: no-op

Each of the first three takes ``cache_salt`` (vLLM's per-request salt): a salted request's
chunk keys are its own (see :mod:`kvtier.keys`), so requests of two salts never share a chunk;
pass the same salt to every call of one request.

Every reference a request takes lives in its lease until ``end_request``. Call it on every
path that ends a request (finished, aborted, failed, timed out): a ``try/finally`` in the
caller, or the :meth:`request` context manager that does it for you.

Two narrower faces are views in their own modules: ``engine.pages()``
(:mod:`kvtier.engine_pages`, for a process that maps the page buffer) and
``engine.receiver_host()`` (:mod:`kvtier.pd.host`, for a decoder's PD receiver). Which tiers
exist is the config's business (:mod:`kvtier.tiers`); the engine opens what it is given.
"""

from __future__ import annotations

import logging
import mmap
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, suppress
from types import TracebackType
from typing import Any

import numpy as np
import torch

from kvtier.config import Config
from kvtier.engine_pages import EnginePages
from kvtier.errors import InputError, StateError
from kvtier.keys import (
    Fingerprint,
    KeyChain,
    RequestKeys,
    RequestSalt,
    as_token_array,
    check_salt,
    keyed_by,
)
from kvtier.layout import KVLayout
from kvtier.lease import Lease, LeaseInfo, LeaseTable
from kvtier.lifecycle import CallGuard, Lifecycle, guarded
from kvtier.memory.block_pool import BlockPool
from kvtier.observability.observer import Observer
from kvtier.observability.stats import engine_stats
from kvtier.pd.host import EngineReceiverHost
from kvtier.storage.audit import audit_references
from kvtier.storage.base import Tier
from kvtier.storage.counters import EngineCounters
from kvtier.storage.manager import StorageManager
from kvtier.storage.plan import ENGINE, LookupPlan
from kvtier.tiers import (
    check_tier_urls,
    clear_tiers,
    cpu_pages,
    given_lower_tiers,
    open_storage,
)
from kvtier.validation import (
    check_fits_in_memory,
    check_kv,
    check_out,
    check_request_id,
    check_skip,
)

log = logging.getLogger(__name__)


EngineState = Lifecycle  # the public name of the engine's lifecycle states

_guarded = guarded  # a public call: counted in flight, refused once close has begun


class Hit(int):
    """What :meth:`Engine.lookup` found: the hit tokens (an ``int``, so a lookup still reads
    as a number), and ``cpu_tokens``: how many of them, from token 0, are in the CPU tier or
    held by the caller (the skip). Those load without reading disk, Redis or PD, so a
    connector loads them in the step and the rest in the background."""

    cpu_tokens: int

    def __new__(cls, tokens: int, cpu_tokens: int = 0) -> Hit:
        hit = super().__new__(cls, tokens)
        hit.cpu_tokens = max(0, min(cpu_tokens, tokens))
        return hit

    @property
    def tokens(self) -> int:
        return int(self)

    def __repr__(self) -> str:
        return f"Hit(tokens={int(self)}, cpu_tokens={self.cpu_tokens})"


class Engine:
    """A tiered KV cache for one model (one tensor-parallel rank).

    Construction validates and sizes everything but allocates nothing and starts no thread;
    :meth:`open` (or ``with Engine(...) as engine``) does. :meth:`close` is idempotent.
    """

    def __init__(
        self,
        config: Config | None,
        layout: KVLayout,
        *,
        model_name: str,
        tp_rank: int = 0,
        tp_world_size: int = 1,
        page_memory: Callable[[int], mmap.mmap] | None = None,
        lower_tiers: Sequence[Tier] | None = None,
    ) -> None:
        """``page_memory(nbytes)`` makes the memory of the CPU page buffer (the kvtier server
        passes shared memory that its clients map); by default it is anonymous memory.

        ``lower_tiers``: ready-made tiers below CPU, unopened, in search order, used instead
        of those the config's tier keys name (tests, embeddings); the engine opens them at
        :meth:`open` and closes them at :meth:`close`, as it does the tiers it builds."""
        if not isinstance(layout, KVLayout):
            raise InputError(f"layout must be a KVLayout, got {type(layout).__name__}")
        self.config = config if config is not None else Config.load()
        if lower_tiers is None:
            check_tier_urls(self.config)  # a scheme no tier is registered for: ConfigError
        else:
            lower_tiers = given_lower_tiers(lower_tiers)
        self._lower_tiers = lower_tiers
        self.layout = layout
        self.fingerprint = Fingerprint(
            model_name=model_name,
            layout=layout,
            chunk_size=self.config.chunk_size,
            hash_algorithm=self.config.pre_caching_hash_algorithm,
            tp_rank=tp_rank,
            tp_world_size=tp_world_size,
            cache_salt=self.config.cache_salt,
        )
        self.chunk_bytes = layout.chunk_bytes(self.config.chunk_size)
        self.num_pages = cpu_pages(self.config, layout)  # staging pages only with a cpu_codec
        check_fits_in_memory("max_local_cpu_size", self.config.max_local_cpu_size)
        self.keychain = KeyChain(self.fingerprint)
        self.counters = EngineCounters()
        self.observer = Observer(self.fingerprint, self.config)  # metrics, explain (no I/O)
        self._guard = CallGuard("Engine")  # the state, and the public calls in flight
        self._state_lock = threading.Lock()  # one open() or close() at a time
        self._pool: BlockPool | None = None
        self._manager: StorageManager | None = None
        self._leases: LeaseTable[LookupPlan] | None = None
        self._page_memory = page_memory

    # -- lifecycle -------------------------------------------------------------------------
    def open(self) -> Engine:
        with self._state_lock:
            if self._guard.state is EngineState.OPEN:
                return self
            if self._guard.state is EngineState.CLOSED:
                raise StateError("this Engine is closed; create a new one")
            self._manager = open_storage(
                self.config,
                self.layout,
                self.fingerprint,
                self.num_pages,
                self.counters,
                self._page_memory,
                self._lower_tiers,
            )
            self._pool = self._manager.pool
            self._leases = LeaseTable[LookupPlan](self._pool)
            self.observer.attach(self._manager)
            self._guard.open()
            log.info(
                "kvtier engine open: %s, %d CPU pages of %d bytes, tiers %s",
                self.layout.describe(),
                self.num_pages,
                self.chunk_bytes,
                [t.name for t in self._manager.tiers],
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
            if not was_open:
                return
        assert self._leases is not None and self._manager is not None and self._pool is not None
        still_open = self._leases.end_all()
        if still_open:
            log.warning(
                "closing with %d requests still open; their leases were released", still_open
            )
        try:
            self._manager.flush(self.config.blocking_timeout_secs)
            self._manager.close()
        finally:
            self._pool.close()

    def __enter__(self) -> Engine:
        return self.open()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def state(self) -> EngineState:
        return self._guard.state

    def _open_parts(self) -> tuple[StorageManager, LeaseTable[LookupPlan]]:
        state = self._guard.state
        if state is not EngineState.OPEN:
            hint = (
                "call open() or use `with Engine(...)`"
                if state is EngineState.NEW
                else "it was closed"
            )
            raise StateError(f"Engine is {state.value}: {hint}")
        assert self._manager is not None and self._leases is not None
        return self._manager, self._leases

    def _call(self) -> AbstractContextManager[None]:
        """A call counted in flight (see ``_guarded``), for the views in other modules."""
        return self._guard.call()

    # -- the request API -------------------------------------------------------------------
    @_guarded
    def lookup(
        self,
        tokens: object,
        request_id: str,
        *,
        skip_leading_tokens: int = 0,
        cache_salt: RequestSalt | None = None,
    ) -> Hit:
        """Tokens of the longest cached prefix (including ``skip_leading_tokens`` the engine
        already holds), pinned for ``request_id`` until :meth:`end_request`; ``cpu_tokens``
        of them in the CPU tier. The prompt's keys stay with the request's lease, so its
        loads do not hash it again (nor its stores, for the chunks the lookup hashed)."""
        started = time.perf_counter()
        manager, leases = self._open_parts()
        check_request_id(request_id)
        check_skip(skip_leading_tokens)
        salt = check_salt(cache_salt)
        tokens = as_token_array(tokens)  # once: the observer reuses the array
        lease = leases.open(request_id)
        keys = self._request_keys(tokens, salt, lease)
        lease.keys = keys  # what the plan below is made of
        spans = keys.spans
        if lease.limit is not None:
            # A load of this request came up short at chunk ``limit``: from there on the
            # chunks are a miss for it, whatever the tiers say now (never offered again).
            spans = spans[: lease.limit]
        plan = manager.locate(spans, lease, skip_leading_tokens // self.config.chunk_size)
        lease.plan = plan
        found = self.observer.on_lookup(request_id, tokens, spans, plan, started, keyed_by(salt))
        # lookup_tokens: the whole prompt, partial tail included. The hit is counted when
        # loaded (_load): a lookup only finds.
        self.counters.add(lookups=1, lookup_tokens=len(tokens), found_tokens=found)
        return Hit(plan.hit_tokens, plan.cpu_tokens)

    @_guarded
    def retrieve(
        self, tokens: object, request_id: str, *, cache_salt: RequestSalt | None = None
    ) -> torch.Tensor:
        """KV of the cached prefix, shape ``[2, layers, hit, kv_heads*head_dim]``.

        ``hit`` may be shorter than :meth:`lookup` said when a lower-tier entry vanished or
        failed its checksum since; the engine recomputes from there.

        After ``lookup(..., skip_leading_tokens=N)`` the first N tokens' chunks were never
        looked up; they are looked up and loaded now, and when the cache does not hold them
        all this raises :class:`InputError`: use :meth:`retrieve_into` with the same skip.
        """
        started = time.perf_counter()
        plan = self._plan(tokens, request_id, 0, cache_salt)
        if plan.hits and plan.hits[0].tier is ENGINE:
            self._locate_skipped(plan, request_id)
        out = torch.empty(self.layout.kv_shape(plan.hit_tokens), dtype=self.layout.dtype)
        loaded = self._load(plan, request_id, out, 0)
        self.observer.on_retrieve(started)
        return out[:, :, :loaded, :]

    @_guarded
    def retrieve_into(
        self,
        tokens: object,
        request_id: str,
        out: torch.Tensor,
        *,
        skip_leading_tokens: int = 0,
        cache_salt: RequestSalt | None = None,
    ) -> int:
        """Write the cached prefix into ``out`` (``[planes, layers, >=hit, hidden]``, indexed by
        token position; any device) without an intermediate copy. Chunks wholly inside
        ``skip_leading_tokens`` are not written. Returns the end of the loaded prefix; rows
        past it may have been written (a chunk that failed its check as it was copied in)."""
        started = time.perf_counter()
        plan = self._plan(tokens, request_id, skip_leading_tokens, cache_salt)
        check_out(out, self.layout, plan.hit_tokens)
        start = (skip_leading_tokens // self.config.chunk_size) * self.config.chunk_size
        loaded_end = self._load(plan, request_id, out, start)
        self.observer.on_retrieve(started)
        return loaded_end

    @_guarded
    def store(
        self,
        tokens: object,
        kv: torch.Tensor,
        *,
        skip_leading_tokens: int = 0,
        cache_salt: RequestSalt | None = None,
        keys: RequestKeys | None = None,
    ) -> int:
        """Store the KV of ``tokens`` (``[2, layers, len(tokens), kv_heads*head_dim]``).

        Chunks already held are skipped without taking anything; chunks wholly inside
        ``skip_leading_tokens`` are hashed but not stored. Returns chunks newly stored. When
        memory is full of pinned pages, the rest is dropped and counted (never waits).
        ``keys``: the tokens' keys from :meth:`request_keys` (nothing is hashed here then).
        """
        started = time.perf_counter()
        manager, _ = self._open_parts()
        array = as_token_array(tokens)
        check_skip(skip_leading_tokens)
        salt = check_salt(cache_salt)
        if keys is None:
            spans = self._request_keys(array, salt, None).spans
        elif (
            not isinstance(keys, RequestKeys)
            or keys.chain is not self.keychain
            or keys.salt != salt
            or not np.array_equal(keys.tokens, array)
        ):
            raise InputError(
                "keys must be this engine's request_keys() of the same tokens and cache_salt"
            )
        else:
            spans = keys.spans
        check_kv(kv, self.layout, len(array))
        self.counters.add(stores=1)
        offered = spans[skip_leading_tokens // self.config.chunk_size :]
        stored, dropped = manager.store(offered, kv)
        self.observer.on_store(array, offered, dropped, started)
        return stored

    @_guarded
    def end_request(self, request_id: str) -> bool:
        """Release everything ``request_id`` holds. Returns False if it held nothing (already
        ended, or never started): calling it twice is safe and never releases twice."""
        _, leases = self._open_parts()
        lease = leases.get(request_id)
        ended = leases.end(request_id)
        if ended:
            unused = self.observer.on_request_end(request_id, lease)
            self.counters.add(requests=1, unused_tokens=unused)
        return ended

    @contextmanager
    def request(self, request_id: str) -> Iterator[str]:
        """``with engine.request(rid):`` ends the request on every way out of the block."""
        try:
            yield request_id
        finally:
            # Closed meanwhile: close ended every request already.
            with suppress(StateError):
                self.end_request(request_id)

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

    def record_ttft(self, seconds: float, *, prompt_tokens: int, hit_tokens: int) -> None:
        """A connector reports a request's time to first token, for the TTFT metrics and the
        dashboard's TTFT-saved estimate (see kvtier.observability.observer)."""
        self.observer.record_ttft(seconds, prompt_tokens=prompt_tokens, hit_tokens=hit_tokens)

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
        A tier that fails is skipped, the others are cleared, then :class:`TierError` names it."""
        manager, _ = self._open_parts()
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
    def tiers(self) -> list[Tier]:
        """The open tiers in search order: cpu, then the lower tiers."""
        manager, _ = self._open_parts()
        return list(manager.tiers)

    # -- views ---------------------------------------------------------------------------------
    def pages(self) -> EnginePages:
        """The page API, for a process that maps the page buffer (:mod:`kvtier.engine_pages`)."""
        return EnginePages(self)

    def receiver_host(self) -> EngineReceiverHost:
        """This engine as a PD receiver sees it (:mod:`kvtier.pd.host`); needs an open engine."""
        manager, leases = self._open_parts()
        return EngineReceiverHost(self.config, self.fingerprint, manager.lower, leases, self._guard)

    # -- helpers ---------------------------------------------------------------------------
    def _request_keys(
        self, tokens: np.ndarray, salt: RequestSalt | None, lease: Lease[LookupPlan] | None
    ) -> RequestKeys:
        """The keys of ``tokens``: reused from the lease where it knows them (only chunks it
        does not know are hashed); the lease keeps them when they extend its tokens."""
        known = lease.keys if lease is not None else None
        if known is None:
            return RequestKeys(self.keychain, tokens, salt, self.config.save_unfull_chunk)
        made = known.for_tokens(tokens, salt)
        if (
            lease is not None
            and made is not known
            and salt == known.salt
            and len(tokens) > len(known.tokens)
            and np.array_equal(tokens[: len(known.tokens)], known.tokens)
        ):
            lease.keys = made  # the same prompt, longer: what a later store hashed
        return made

    @_guarded
    def request_keys(
        self,
        tokens: object,
        request_id: str | None = None,
        *,
        cache_salt: RequestSalt | None = None,
    ) -> RequestKeys:
        """The chunk keys of ``tokens`` for ``request_id``, to pass to :meth:`store` and to
        name its chunks (events, PD). What the request's lookup hashed is reused (a request
        is hashed once); without a request id, or for one with no lease, they are hashed."""
        _, leases = self._open_parts()
        lease = None
        if request_id is not None:
            check_request_id(request_id)
            lease = leases.get(request_id)
        return self._request_keys(as_token_array(tokens), check_salt(cache_salt), lease)

    @contextmanager
    def loading(self, request_id: str) -> Iterator[bool]:
        """``with engine.loading(rid) as live:`` load ``rid``'s hit only when ``live`` (it
        holds a lease: looked up and not ended; a retrieve for an ended request would open
        a lease nobody ends). Inside the block an :meth:`end_request` of ``rid`` (from
        another thread) returns at once and releases the lease when the block exits: the
        pages the load reads stay pinned until its last byte is copied."""
        _, leases = self._open_parts()
        lease = leases.begin_busy(request_id)
        try:
            yield lease is not None
        finally:
            if lease is not None:
                leases.end_busy(lease)

    def _plan(
        self, tokens: object, request_id: str, skip_leading_tokens: int, salt: RequestSalt | None
    ) -> LookupPlan:
        _, leases = self._open_parts()
        check_request_id(request_id)
        check_skip(skip_leading_tokens)
        salt = check_salt(salt)
        lease = leases.get(request_id)
        if lease is not None and lease.plan is not None and lease.keys is not None:
            # The lookup's tokens stay with the lease: the same hit prefix (a memory compare,
            # no hash) reuses the plan it pinned.
            array = as_token_array(tokens)
            hit = lease.plan.hit_tokens
            known = lease.keys
            if (
                salt == known.salt
                and len(array) >= hit
                and np.array_equal(array[:hit], known.tokens[:hit])
            ):
                return lease.plan
        self.lookup(tokens, request_id, skip_leading_tokens=skip_leading_tokens, cache_salt=salt)
        lease = leases.get(request_id)
        assert lease is not None and lease.plan is not None
        return lease.plan

    def _locate_skipped(self, plan: LookupPlan, request_id: str) -> None:
        """Replace the plan's leading ENGINE chunks (skipped at lookup: the caller said it
        holds them) with cached ones, pinned in the lease, or raise: never leave them as
        uninitialised rows of a tensor that claims to be KV."""
        manager, leases = self._open_parts()
        lease = leases.get(request_id)
        if lease is None:
            raise StateError(f"request {request_id!r} ended before its retrieve")
        skipped = [h.span for h in plan.hits if h.tier is ENGINE]
        found = manager.locate(skipped, lease, 0)
        if len(found.hits) < len(skipped):
            n = skipped[-1].end
            raise InputError(
                f"request {request_id!r} was looked up with skip_leading_tokens covering its "
                f"first {n} tokens, and the cache holds only {found.hit_tokens} of them: "
                f"retrieve() returns KV from token 0, so call retrieve_into(tokens, "
                f"{request_id!r}, out, skip_leading_tokens={n}) instead"
            )
        plan.hits[: len(skipped)] = found.hits
        plan.spare.extend(found.spare)

    def _load(self, plan: LookupPlan, request_id: str, out: torch.Tensor | None, start: int) -> int:
        manager, leases = self._open_parts()
        lease = leases.get(request_id)
        if lease is None:
            raise StateError(f"request {request_id!r} ended before its retrieve")
        before = self.observer.before_load(plan)
        planned = plan.hit_tokens
        loaded = manager.load(plan, lease, out, start)
        if loaded < planned:
            lease.limit = plan.hit_chunks  # the rest is a miss for this request from now on
        self.observer.after_load(request_id, before, loaded)
        copied = self.observer.on_loaded(request_id, plan, start, loaded)
        self.counters.add(retrieved_tokens=copied, hit_tokens=copied)
        return loaded
