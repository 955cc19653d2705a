"""The public entry point: :class:`Engine`.

Who calls what::

    engine.lookup(tokens, request_id)       -> hit tokens; pins the hit prefix in the lease
    engine.retrieve(tokens, request_id)     -> KV of the hit prefix (loads lower-tier chunks)
    engine.store(tokens, kv)                -> stores the chunks not yet held (never blocks)
    engine.end_request(request_id)          -> releases everything the request holds; again: no-op

Every reference a request takes lives in its lease until ``end_request``. Call it on every
path that ends a request (finished, aborted, failed, timed out): a ``try/finally`` in the
caller, or the :meth:`request` context manager that does it for you.
"""

from __future__ import annotations

import functools
import logging
import mmap
import threading
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager, suppress
from types import TracebackType
from typing import Any, Concatenate, ParamSpec, TypeVar

import torch

from kvtier.config import Config
from kvtier.errors import InputError, StateError, TierError
from kvtier.keys import ChunkSpans, Fingerprint, KeyChain, as_token_array
from kvtier.layout import KVLayout
from kvtier.lease import Hold, LeaseInfo, LeaseTable
from kvtier.lifecycle import CallGuard, Lifecycle
from kvtier.memory.block_pool import BlockPool, pages_for_capacity
from kvtier.observability.observer import Observer
from kvtier.pd.buffer import PDBuffer
from kvtier.storage.audit import audit_references
from kvtier.storage.base import Tier
from kvtier.storage.counters import EngineCounters
from kvtier.storage.cpu import CpuTier
from kvtier.storage.factory import build_lower_tiers
from kvtier.storage.manager import ENGINE, LookupPlan, StorageManager, StoreSlot
from kvtier.validation import (
    check_dense,
    check_fits_in_memory,
    check_kv,
    check_request_id,
    check_skip,
)

log = logging.getLogger(__name__)


EngineState = Lifecycle  # the public name of the engine's lifecycle states

P = ParamSpec("P")
R = TypeVar("R")


def _guarded(method: Callable[Concatenate[Engine, P], R]) -> Callable[Concatenate[Engine, P], R]:
    """A public call that uses the engine's parts: counted in flight (so :meth:`Engine.close`
    waits for it before freeing them) and refused with StateError once close has begun."""

    @functools.wraps(method)
    def call(self: Engine, /, *args: P.args, **kwargs: P.kwargs) -> R:
        with self._guard.call():
            return method(self, *args, **kwargs)

    return call


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
    ) -> None:
        """``page_memory(nbytes)`` makes the memory of the CPU page buffer (the kvtier server
        passes shared memory that its clients map); by default it is anonymous memory."""
        if not isinstance(layout, KVLayout):
            raise InputError(f"layout must be a KVLayout, got {type(layout).__name__}")
        self.config = config if config is not None else Config.load()
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
        self.num_pages = pages_for_capacity(
            "max_local_cpu_size", self.config.max_local_cpu_size, self.chunk_bytes
        )
        check_fits_in_memory("max_local_cpu_size", self.num_pages * self.chunk_bytes)
        self.keychain = KeyChain(self.fingerprint)
        self.counters = EngineCounters()
        self.observer = Observer(self.fingerprint, self.config)  # metrics, explain (no I/O)
        self._guard = CallGuard("Engine")  # the state, and the public calls in flight
        self._state_lock = threading.Lock()  # one open() or close() at a time
        self._pool: BlockPool | None = None
        self._manager: StorageManager | None = None
        self._leases: LeaseTable[LookupPlan] | None = None
        self._pd_buffer: PDBuffer | None = None
        self._page_memory = page_memory

    # -- lifecycle -------------------------------------------------------------------------
    def open(self) -> Engine:
        with self._state_lock:
            if self._guard.state is EngineState.OPEN:
                return self
            if self._guard.state is EngineState.CLOSED:
                raise StateError("this Engine is closed; create a new one")
            memory = self._page_memory
            pool = BlockPool(
                self.num_pages,
                self.chunk_bytes,
                mapping=memory(self.num_pages * self.chunk_bytes) if memory else None,
            )
            lower: list[Tier] = []
            try:
                if self.config.enable_pd and self.config.pd_role == "receiver":
                    # First below CPU: what the prefiller sent is what this decoder needs.
                    lower.append(PDBuffer.from_config(self.config, self.layout, self.fingerprint))
                lower.extend(build_lower_tiers(self.config, self.layout, self.fingerprint))
                for tier in lower:
                    tier.open()
            except BaseException:
                for tier in lower:
                    tier.close()
                pool.close()
                raise
            cpu = CpuTier(pool, self.layout.token_bytes())
            self._pool = pool
            self._pd_buffer = next((t for t in lower if isinstance(t, PDBuffer)), None)
            self._leases = LeaseTable[LookupPlan](pool)
            self._manager = StorageManager(
                self.config, self.layout, pool, cpu, lower, self.counters
            )
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

    # -- the request API -------------------------------------------------------------------
    @_guarded
    def lookup(self, tokens: object, request_id: str, *, skip_leading_tokens: int = 0) -> int:
        """Tokens of the longest cached prefix (including ``skip_leading_tokens`` the engine
        already holds), pinned for ``request_id`` until :meth:`end_request`."""
        started = time.perf_counter()
        manager, leases = self._open_parts()
        check_request_id(request_id)
        tokens = as_token_array(tokens)  # once: the observer reuses the array
        spans = self._spans(tokens, skip_leading_tokens)
        lease = leases.open(request_id)
        plan = manager.locate(spans, lease, skip_leading_tokens // self.config.chunk_size)
        lease.plan = plan
        # lookup_tokens: the whole prompt, partial tail included
        self.counters.add(lookups=1, lookup_tokens=len(tokens), hit_tokens=plan.hit_tokens)
        self.observer.on_lookup(request_id, tokens, spans, plan, started)
        return plan.hit_tokens

    @_guarded
    def retrieve(self, tokens: object, request_id: str) -> torch.Tensor:
        """KV of the cached prefix, shape ``[2, layers, hit, kv_heads*head_dim]``.

        ``hit`` may be shorter than :meth:`lookup` said when a lower-tier entry vanished or
        failed its checksum since; the engine recomputes from there.

        After ``lookup(..., skip_leading_tokens=N)`` the first N tokens' chunks were never
        looked up; they are looked up and loaded now, and when the cache does not hold them
        all this raises :class:`InputError`: use :meth:`retrieve_into` with the same skip.
        """
        started = time.perf_counter()
        plan = self._plan(tokens, request_id, 0)
        if plan.hits and plan.hits[0].tier == ENGINE:
            self._locate_skipped(plan, request_id)
        out = torch.empty(self.layout.kv_shape(plan.hit_tokens), dtype=self.layout.dtype)
        loaded = self._load(plan, request_id, out, 0)
        self.observer.on_retrieve(started)
        return out[:, :, :loaded, :]

    @_guarded
    def retrieve_into(
        self, tokens: object, request_id: str, out: torch.Tensor, *, skip_leading_tokens: int = 0
    ) -> int:
        """Write the cached prefix into ``out`` (``[2, layers, >=hit, hidden]``, indexed by
        token position; any device) without an intermediate copy. Chunks wholly inside
        ``skip_leading_tokens`` are not written. Returns the end of the loaded prefix."""
        started = time.perf_counter()
        plan = self._plan(tokens, request_id, skip_leading_tokens)
        lay = self.layout
        if isinstance(out, torch.Tensor):
            check_dense("out", out)
        if (
            not isinstance(out, torch.Tensor)
            or out.dtype != lay.dtype
            or out.dim() != 4
            or tuple(out.shape[:2]) != lay.kv_shape(0)[:2]
            or out.shape[3] != lay.hidden
            or out.shape[2] < plan.hit_tokens
        ):
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise InputError(
                f"out must be a {lay.dtype} tensor of shape "
                f"[{lay.planes}, {lay.num_layers}, >={plan.hit_tokens}, {lay.hidden}], got {shape}"
            )
        start = (skip_leading_tokens // self.config.chunk_size) * self.config.chunk_size
        loaded_end = self._load(plan, request_id, out, start)
        self.observer.on_retrieve(started)
        return loaded_end

    @_guarded
    def store(self, tokens: object, kv: torch.Tensor, *, skip_leading_tokens: int = 0) -> int:
        """Store the KV of ``tokens`` (``[2, layers, len(tokens), kv_heads*head_dim]``).

        Chunks already held are skipped without taking anything; chunks wholly inside
        ``skip_leading_tokens`` are hashed but not stored. Returns chunks newly stored. When
        memory is full of pinned pages, the rest is dropped and counted (never waits).
        """
        started = time.perf_counter()
        manager, _ = self._open_parts()
        array = as_token_array(tokens)
        spans = self._spans(array, skip_leading_tokens)
        check_kv(kv, self.layout, len(array))
        self.counters.add(stores=1)
        offered = spans[skip_leading_tokens // self.config.chunk_size :]
        stored, dropped = manager.store(offered, kv)
        self.observer.on_store(array, offered, dropped, started)
        return stored

    # -- pages, for a process that maps the page buffer (kvtier.server) ----------------------
    @_guarded
    def lease_pages(
        self, tokens: object, request_id: str, *, skip_leading_tokens: int = 0
    ) -> tuple[int, list[tuple[int, int, int]]]:
        """:meth:`retrieve_into` without the copy: the chunks of the cached prefix from the
        skip on, each resident in a page that ``request_id``'s lease holds until
        :meth:`end_request`. Returns (end of the loaded prefix, [(page, start, tokens)])."""
        started = time.perf_counter()
        plan = self._plan(tokens, request_id, skip_leading_tokens)
        start = (skip_leading_tokens // self.config.chunk_size) * self.config.chunk_size
        loaded_end = self._load(plan, request_id, None, start)
        self.observer.on_retrieve(started)
        pages = [
            (h.page, h.span.start, h.span.num_tokens)
            for h in plan.hits
            if h.tier != ENGINE and h.span.end > start and h.page is not None
        ]
        return loaded_end, pages

    @_guarded
    def reserve_pages(
        self, tokens: object, request_id: str, *, skip_leading_tokens: int = 0
    ) -> list[StoreSlot]:
        """:meth:`store` without the copy: a page for each chunk of ``tokens`` not yet held
        (from the skip on), held by ``request_id``'s lease. Fill them, then
        :meth:`commit_pages`; ending the request first gives them back unstored."""
        started = time.perf_counter()
        manager, leases = self._open_parts()
        check_request_id(request_id)
        array = as_token_array(tokens)
        spans = self._spans(array, skip_leading_tokens)
        self.counters.add(stores=1)
        offered = spans[skip_leading_tokens // self.config.chunk_size :]
        slots, dropped = manager.reserve(offered)
        leases.open(request_id).take_pages([slot.page for slot in slots])
        self.observer.on_store(array, offered, dropped, started)
        return slots

    @_guarded
    def commit_pages(self, request_id: str, slots: list[StoreSlot]) -> int:
        """Publish pages :meth:`reserve_pages` gave ``request_id`` and filled since, then end
        the request. Returns chunks newly stored."""
        manager, leases = self._open_parts()
        lease = leases.get(request_id)
        if lease is None or not set(s.page for s in slots) <= set(lease.pages):
            raise StateError(f"request {request_id!r} holds no reservation for these pages")
        stored = manager.commit(slots)
        self.end_request(request_id)
        return stored

    @_guarded
    def end_request(self, request_id: str) -> bool:
        """Release everything ``request_id`` holds. Returns False if it held nothing (already
        ended, or never started): calling it twice is safe and never releases twice."""
        _, leases = self._open_parts()
        lease = leases.get(request_id)
        ended = leases.end(request_id)
        if ended:
            self.counters.add(requests=1)
            self.observer.on_request_end(lease)
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
        manager, leases = self._open_parts()
        pool = manager.pool
        lease_infos = leases.snapshot()
        tiers: dict[str, Any] = {}
        for tier in manager.tiers:
            usage = tier.usage()
            tiers[tier.name] = {
                "used_bytes": usage.used_bytes,
                "capacity_bytes": usage.capacity_bytes,
                "entries": usage.entries,
                **tier.counters.as_dict(),
            }
        counts = self.counters.as_dict()
        counts["miss_tokens"] = counts["lookup_tokens"] - counts["hit_tokens"]
        return {
            "open_requests": len(lease_infos),
            "pinned_pages": sum(i.pinned_pages for i in lease_infos),
            "pinned_bytes": sum(i.pinned_bytes for i in lease_infos),
            "pinned_by_request": {
                i.request_id: {"pages": i.pinned_pages, "bytes": i.pinned_bytes}
                for i in lease_infos
            },
            "allocator": {
                "page_bytes": pool.page_bytes,
                "pages_total": pool.num_pages,
                "pages_free": pool.free_pages,
                "pages_used": pool.used_pages,
            },
            "tiers": tiers,
            **counts,
        }

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
        if self._pd_buffer is not None:
            problems.extend(self._pd_buffer.audit(leases))
        return problems

    @_guarded
    def clear(self) -> dict[str, int]:
        """Drop every unpinned entry of every tier (pinned ones stay); tier -> entries dropped.
        A tier that fails is skipped, the others are cleared, then :class:`TierError` names it."""
        manager, _ = self._open_parts()
        dropped: dict[str, int] = {}
        failed: list[str] = []
        for tier in manager.tiers:
            try:
                dropped[tier.name] = tier.clear()
            except TierError as exc:
                failed.append(f"{tier.name}: {exc}")
        if failed:
            raise TierError(f"clear dropped {dropped} but failed on " + "; ".join(failed))
        return dropped

    @_guarded
    def flush(self, timeout: float | None = None) -> bool:
        """Wait for in-flight lower-tier writes. True when all landed."""
        manager, _ = self._open_parts()
        return manager.flush(timeout)

    @property
    def pd_buffer(self) -> PDBuffer | None:
        """The decoder's PD receive buffer (``enable_pd`` with ``pd_role: receiver``), or None."""
        self._open_parts()
        return self._pd_buffer

    @_guarded
    def tier(self, name: str) -> Tier | None:
        """The open tier called ``name`` (``"cpu"``, ``"disk"``, ``"pd"``, ...), or None."""
        manager, _ = self._open_parts()
        return next((t for t in manager.tiers if t.name == name), None)

    @_guarded
    def attach_hold(self, request_id: str, hold: Hold) -> None:
        """Put ``hold`` (e.g. a PD reservation) into ``request_id``'s lease: released, once,
        by :meth:`end_request`. Raises StateError, with the hold already released, if the
        request ended before (or while) the hold arrived: a late transfer never opens a lease
        that nobody would end."""
        _, leases = self._open_parts()
        check_request_id(request_id)
        try:
            lease = leases.join(request_id)
        except StateError:
            hold.release()
            raise
        lease.take_hold(hold)

    def expire_unclaimed(self, ttl: float, busy: Collection[str] = ()) -> list[str]:
        """End the requests that only a PD receiver opened (:meth:`attach_hold`) and that
        no lookup claimed within ``ttl`` seconds: cancelled upstream, routed to another
        decoder, or never real. Their reservations go back to the buffer, once; a later
        ``end_request`` for them is a no-op. ``busy``: requests whose transfer is still in
        flight (kept; their TTL starts again). Returns the ids ended."""
        _, leases = self._open_parts()
        return leases.expire_unclaimed(ttl, busy=busy)

    # -- helpers ---------------------------------------------------------------------------
    def _spans(self, tokens: object, skip_leading_tokens: int) -> ChunkSpans:
        check_skip(skip_leading_tokens)
        return self.keychain.keys(tokens, include_partial=self.config.save_unfull_chunk)

    def _plan(self, tokens: object, request_id: str, skip_leading_tokens: int) -> LookupPlan:
        _, leases = self._open_parts()
        check_request_id(request_id)
        lease = leases.get(request_id)
        if lease is not None and lease.plan is not None:
            keys = self._spans(tokens, skip_leading_tokens).keys
            plan = lease.plan
            hit = plan.hit_chunks
            if tuple(keys[:hit]) == plan.keys[:hit]:
                return plan
        self.lookup(tokens, request_id, skip_leading_tokens=skip_leading_tokens)
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
        skipped = [h.span for h in plan.hits if h.tier == ENGINE]
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

    def _load(self, plan: LookupPlan, request_id: str, out: torch.Tensor | None, start: int) -> int:
        manager, leases = self._open_parts()
        lease = leases.get(request_id)
        if lease is None:
            raise StateError(f"request {request_id!r} ended before its retrieve")
        before = self.observer.before_load(plan)
        loaded = manager.load(plan, lease, out, start)
        self.observer.after_load(request_id, before, loaded)
        self.counters.add(retrieved_tokens=max(0, loaded - start))
        return loaded
