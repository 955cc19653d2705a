"""The storage manager: the tier roles, and the store across them.

A request's path through the tiers is three jobs, each in its own module: the lookup finds and
pins the longest held prefix (:mod:`kvtier.storage.lookup`), the load copies it out
(:mod:`kvtier.storage.loads`), and the store (here) hands new chunks to the tiers that lack
them. The manager builds the first two from the tier roles below and owns the tiers' lifecycle.

Tier roles (the three modes LMCache users run, see README)::

    local_cpu  use_only_staging_buffer   CPU index visible   disk/remote hit copied to CPU
    true       (ignored)                 yes                 yes
    false      false                     yes                 no
    false      true                      no (staging only)   no

Store: each new chunk is copied once into a page (by the device-copy owner,
:mod:`kvtier.memory.device`: the pages are handed on only once the copy has landed, since every
owner below reads them on the host); the CPU index (when visible) and each lower tier write own
one reference each. A write's reference comes back through its completion
callback, exactly once (``WriteTicket``, :mod:`kvtier.storage.writes`), so staging pages
return to the free list as soon as the lower tier has the bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from kvtier.config import Config
from kvtier.errors import KVTierError, StateError
from kvtier.keys import ChunkKey, ChunkSpan
from kvtier.layout import Copy, KVLayout
from kvtier.lease import Lease
from kvtier.memory.block_pool import BlockPool
from kvtier.memory.device import CopyEngine, DeviceCopies, Direction
from kvtier.storage.base import PutJob, PutOutcome, PutResult, Tier
from kvtier.storage.counters import EngineCounters
from kvtier.storage.cpu import CpuTier
from kvtier.storage.loads import PlanLoader
from kvtier.storage.lookup import LookupPlan, PrefixLookup
from kvtier.storage.tenants.ledger import NO_SALT
from kvtier.storage.tenants.quotas import TenantQuotas
from kvtier.storage.writes import StoreSlot, WritesInFlight, WriteTicket

log = logging.getLogger(__name__)


class StorageManager:
    def __init__(
        self,
        config: Config,
        layout: KVLayout,
        pool: BlockPool,
        cpu: CpuTier,
        lower: Sequence[Tier],
        counters: EngineCounters,
        copies: CopyEngine | None = None,
        quotas: TenantQuotas | None = None,
    ) -> None:
        """``copies``: the owner of every copy between a device tensor and the pages
        (:class:`DeviceCopies` by default; tests inject one whose copies land late).
        ``quotas``: the engine's one quota table (``tenant_quotas``), which every tier's
        ledger reads; None without quotas."""
        self.config = config
        self.quotas = quotas
        self.layout = layout
        self.pool = pool
        self.cpu = cpu
        self.lower = list(lower)
        self.counters = counters
        self.copies = copies if copies is not None else DeviceCopies()
        self.writes_in_flight = WritesInFlight()
        self.cpu_visible = config.local_cpu or not config.use_only_staging_buffer
        self.promote_to_cpu = config.local_cpu
        self._lookup = PrefixLookup(cpu, self.lower, cpu_visible=self.cpu_visible)
        self._loader = PlanLoader(
            layout,
            pool,
            cpu,
            counters,
            self.writes_in_flight,
            self.copies,
            promote_to_cpu=self.promote_to_cpu,
        )

    @property
    def tiers(self) -> list[Tier]:
        return [self.cpu, *self.lower]

    def locate(
        self, spans: Sequence[ChunkSpan], lease: Lease[LookupPlan], skip_chunks: int
    ) -> LookupPlan:
        """Find and pin the longest prefix of ``spans`` held by the engine or some tier
        (:meth:`PrefixLookup.locate <kvtier.storage.lookup.PrefixLookup.locate>`)."""
        return self._lookup.locate(spans, lease, skip_chunks)

    def load(
        self,
        plan: LookupPlan,
        lease: Lease[LookupPlan],
        out: torch.Tensor | None,
        start_token: int,
        base: int = 0,
    ) -> int:
        """Copy the plan's chunks from ``start_token`` on into ``out`` (row 0: token ``base``);
        returns the end of what was loaded
        (:meth:`PlanLoader.load <kvtier.storage.loads.PlanLoader.load>`)."""
        return self._loader.load(plan, lease, out, start_token, base)

    # -- store -----------------------------------------------------------------------------
    def store(
        self,
        spans: Sequence[ChunkSpan],
        kv: torch.Tensor,
        tenant: str | None = None,
        base: int = 0,
    ) -> tuple[int, int]:
        """Copy each chunk not yet held into a page and hand it to the tiers that lack it.
        Returns (chunks newly stored somewhere, chunks dropped). When no page can be freed,
        the rest is dropped (counted): a store never waits. ``tenant``: the request's
        ``cache_salt``, whose quota the chunks count against. ``base``: the token ``kv``'s row 0
        holds (a chunk start at or before the first span). A coded CPU tier's pages are only
        staging (``CpuTier.resident`` false): there the chunks go through in batches of what
        the pool holds, each batch's pages back in the pool before the next is reserved."""
        step = len(spans) if self.cpu.resident else max(1, self.pool.num_pages // 2)
        if not self.cpu.resident and self.cpu_visible and spans:  # evict before the inserts
            self.cpu.make_room(self.cpu.contains([s.key for s in spans]).count(False))
        stored = dropped = 0
        for at in range(0, len(spans), max(step, 1)):
            slots, dropped = self.reserve(spans[at : at + step], tenant)
            pages = [slot.page for slot in slots]
            try:
                batch = self.copies.begin(kv, Direction.STORE)
                try:
                    for slot in slots:
                        self._copy_in(kv, slot.span, slot.page, batch.copy, base)
                finally:
                    # Landed before the pages reach any owner (the CPU index serves them,
                    # writer threads checksum and write them, a codec reads them, all on the
                    # host), and before a failed store gives them back to the pool.
                    batch.close().wait()
                stored += self.commit(slots)
            finally:
                self.pool.release(pages)  # the reservation's own references (owners took theirs)
            if dropped:  # no page for the rest either: counted as dropped too
                rest = max(0, len(spans) - at - step)
                self.counters.add(dropped_chunks=rest)
                dropped += rest
                break
        self.cpu.enforce_quota(tenant)  # the new chunks' own pages are evictable only now
        return stored, dropped

    def reserve(
        self, spans: Sequence[ChunkSpan], tenant: str | None = None
    ) -> tuple[list[StoreSlot], int]:
        """A page for each chunk some tier lacks, each with one reference for the caller.
        Returns (slots, chunks dropped): when no page can be freed, the rest is dropped and
        counted. Fill the pages, :meth:`commit` them, then release the caller's references;
        releasing without a commit gives the pages back unstored."""
        if not spans:
            return [], 0
        keys = [s.key for s in spans]
        cpu_has = self.cpu.contains(keys) if self.cpu_visible else [True] * len(keys)
        lower_has = [
            self._contains_or_none(tier, keys) if tier.accepts_puts else None for tier in self.lower
        ]
        slots: list[StoreSlot] = []
        dropped = 0
        for i, span in enumerate(spans):
            writers = [
                t
                for t, has in zip(self.lower, lower_has, strict=True)
                if has is not None and not has[i]
            ]
            to_cpu = not cpu_has[i]
            if not writers and not to_cpu:
                continue
            pages = self.cpu.allocate(1)
            if pages is None:
                dropped = len(spans) - i
                log.debug("store dropped %d chunks: every CPU page is in use", dropped)
                break
            slots.append(StoreSlot(span, pages[0], writers, to_cpu, tenant))
        self.counters.add(dropped_chunks=dropped)
        return slots, dropped

    def commit(self, slots: Sequence[StoreSlot]) -> int:
        """Hand each filled page to its owners (the CPU index, each lower-tier write), each
        taking a reference of its own; the caller keeps (and later releases) its reservation's.
        Returns the chunks newly stored."""
        for slot in slots:
            self._hand_out(slot.span, slot.page, slot.to_cpu, slot.writers, slot.tenant)
        self.counters.add(stored_chunks=len(slots))
        return len(slots)

    def _hand_out(
        self, span: ChunkSpan, page: int, to_cpu: bool, writers: list[Tier], tenant: str | None
    ) -> None:
        """Give the CPU index and each lower-tier write a reference to ``page`` of its own."""
        if to_cpu:
            self.pool.retain([page])
            if not self.cpu.insert(span.key, page, span.num_tokens, tenant):
                self.pool.release([page])  # raced with another store of the same key
        payload = self.pool.page_bytes_view(page, self.layout.payload_bytes(span.num_tokens))
        for tier in writers:
            self.pool.retain([page])
            ticket = WriteTicket(self.writes_in_flight, self.pool, self.counters, tier, page)
            try:  # the tenant rides the put (a tier with a ledger charges it the chunk)
                tier.put(PutJob(span.key, payload, span.num_tokens, tenant or NO_SALT, ticket))
            except Exception as exc:  # put must report through on_done; if it raised
                # instead, complete the ticket here so its page reference comes back.
                log.error("tier %s put raised instead of completing: %s", tier.name, exc)
                ticket(PutResult(span.key, PutOutcome.FAILED, str(exc)))

    def held(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Per key, whether some tier holds it now (nothing pinned: a probe before a
        lookup; a tier that fails counts as not holding)."""
        found = list(self.cpu.contains(keys)) if self.cpu_visible else [False] * len(keys)
        for tier in self.lower:
            missing = [i for i, present in enumerate(found) if not present]
            if not missing:
                break
            answers = self._contains_or_none(tier, [keys[i] for i in missing], "probing")
            for i, present in zip(missing, answers or (), strict=False):
                found[i] = present
        return found

    def _contains_or_none(
        self, tier: Tier, keys: list[ChunkKey], doing: str = "writing to"
    ) -> list[bool] | None:
        try:
            return tier.contains(keys)
        except KVTierError as exc:
            log.warning("tier %s is unavailable, not %s it: %s", tier.name, doing, exc)
            return None

    def _copy_in(self, kv: torch.Tensor, span: ChunkSpan, page: int, copy: Copy, base: int) -> None:
        lay = self.layout
        dst = self.pool.page_bytes_view(page, lay.payload_bytes(span.num_tokens))
        lay.pack(kv[:, :, span.start - base : span.end - base, :], dst, copy)

    # -- lifecycle -------------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> bool:
        return all(tier.flush(timeout) for tier in self.lower)

    def close(self) -> None:
        errors: list[str] = []
        for tier in self.lower:
            try:
                tier.close()
            except KVTierError as exc:
                errors.append(f"{tier.name}: {exc}")
        self.cpu.close()
        if errors:
            raise StateError("tiers failed to close cleanly: " + "; ".join(errors))
