"""The storage manager: one chained-prefix lookup across tiers, and the tier roles.

Lookup (``locate``): chunk ``i`` counts only if chunks ``0..i-1`` count, and a chunk counts
when *some* tier holds it::

    chunk:     0    1    2    3    4
    cpu:       x    .    x    .    x
    disk:      .    x    .    .    x
    counts:    x    x    x    .    .      -> hit = 3 chunks (3 is nowhere, so 4 cannot count)

Every counted chunk is pinned for the request in its lease: a CPU page reference, or a pin on
the lower-tier entry (a tier that cannot pin, such as a shared remote store, may still miss
at retrieve; the hit then ends there and the engine recomputes the rest).

A lower-tier chunk is read into a CPU page at load time, so the lookup also reserves one free
page per lower-tier chunk of the hit (``LookupPlan.spare``, held by the lease): a hit is never
promised that cannot get a page to load into. When the pages run out the hit ends before the
first lower-tier chunk without one (declined now, rather than failing at load). A tier whose
chunks are already in memory (``Tier.serves_views``: the PD buffer) is read straight into the
caller's tensor instead, its check fused with that one copy, when the caller gives one and
the chunk is not to be copied back to the CPU tier; the page reserved for it stays unused.

Tier roles (the three modes LMCache users run, see README)::

    local_cpu  use_only_staging_buffer   CPU index visible   disk/remote hit copied to CPU
    true       (ignored)                 yes                 yes
    false      false                     yes                 no
    false      true                      no (staging only)   no

Store: each new chunk is copied once into a page; the CPU index (when visible) and each lower
tier write own one reference each. A write's reference comes back through its completion
callback, exactly once (``WriteTicket``, :mod:`kvtier.storage.writes`), so staging pages
return to the free list as soon as the lower tier has the bytes.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from kvtier.config import Config
from kvtier.errors import KVTierError, StateError
from kvtier.keys import ChunkKey, ChunkSpan, ChunkSpans
from kvtier.layout import KVLayout
from kvtier.lease import CallbackHold, Lease
from kvtier.memory.block_pool import BlockPool
from kvtier.storage.base import PutOutcome, PutResult, ReadAbandoned, Tier
from kvtier.storage.counters import EngineCounters
from kvtier.storage.cpu import CpuTier
from kvtier.storage.plan import ENGINE, ChunkHit, LookupPlan, Source
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
    ) -> None:
        self.config = config
        self.layout = layout
        self.pool = pool
        self.cpu = cpu
        self.lower = list(lower)
        self.counters = counters
        self.writes_in_flight = WritesInFlight()
        self.cpu_visible = config.local_cpu or not config.use_only_staging_buffer
        self.promote_to_cpu = config.local_cpu

    @property
    def tiers(self) -> list[Tier]:
        return [self.cpu, *self.lower]

    # -- lookup ----------------------------------------------------------------------------
    def locate(
        self, spans: Sequence[ChunkSpan], lease: Lease[LookupPlan], skip_chunks: int
    ) -> LookupPlan:
        """Find and pin the longest prefix of ``spans`` held by the engine or some tier.

        The common case, a prefix held in CPU memory, is pinned in one call without an object
        per chunk (``CpuTier.pin_prefix``); the chunks after it are looked up tier by tier."""
        if not isinstance(spans, ChunkSpans):
            spans = ChunkSpans([s.key for s in spans], *_geometry(spans))
        skip = min(skip_chunks, len(spans))
        runs: list[tuple[Source, int, int]] = [(ENGINE, 0, skip)] if skip else []
        pages: list[int | None] = [None] * skip
        done = skip
        if self.cpu_visible and self.cpu.resident and done < len(spans):
            cpu_pages = self.cpu.pin_prefix(spans.keys[done:] if done else spans.keys)
            lease.take_pages(cpu_pages)
            if cpu_pages:
                pages += cpu_pages
                runs.append((self.cpu, done, done + len(cpu_pages)))
                if self.lower:  # their copies were used too (Tier.touch)
                    used = spans.keys[done : done + len(cpu_pages)]
                    for tier in self.lower:
                        tier.touch(used)
                done += len(cpu_pages)
        spare: list[int] = []
        if done < len(spans):
            rest = spans[done:]
            located = self._locate_each(rest, lease)
            located, spare = self._reserve_loads(located, lease)
            for hit in located:
                index = hit.span.index - spans.first
                pages.append(hit.page)
                if runs and runs[-1][0] is hit.tier and runs[-1][2] == index:
                    runs[-1] = (hit.tier, runs[-1][1], index + 1)
                else:
                    runs.append((hit.tier, index, index + 1))
        return LookupPlan(spans, runs, pages, spare=spare)

    def _reserve_loads(
        self, hits: list[ChunkHit], lease: Lease[LookupPlan]
    ) -> tuple[list[ChunkHit], list[int]]:
        """A free page, held by the lease, for each lower-tier chunk of ``hits`` to be read
        into at load. Where pages run out the hit ends (before the first chunk without one):
        a hit that could not be loaded is never promised. Beside a coded CPU tier
        (``CpuTier.resident`` false: its pages are only staging) the chunks need one page
        between them when they are loaded into the caller's tensor, which recycles it
        (``load``): with one reserved the whole hit is promised (a reader of pages,
        ``out=None``, may then get less: the hit ends where the pages do)."""
        lower = [i for i, h in enumerate(hits) if h.page is None]
        spare = self.cpu.allocate(len(lower)) if lower else []
        if spare is None:  # short of pages: as many as there are, one at a time
            spare = []
            for _ in lower:
                got = self.cpu.allocate(1)
                if got is None:
                    break
                spare.extend(got)
        lease.take_pages(spare)
        short = [i for i in lower[len(spare) :] if not spare or self.cpu.resident]
        if short:
            end = short[0]
            log.debug(
                "lookup declined %d lower-tier chunks: no free CPU page to load them into",
                len(hits) - end,
            )
            hits = hits[:end]  # their pins stay in the lease until it ends
        return hits, spare

    def _load_pages(self, plan: LookupPlan, lease: Lease[LookupPlan], count: int) -> list[int]:
        """Up to ``count`` pages for lower-tier reads, each with one reference for the caller:
        the plan's reserved ones first (taken back from the lease), then fresh ones if the
        pool has them. Fewer (maybe none) when neither has enough."""
        take = plan.spare[:count]
        if take:
            lease.untake_pages(take)  # StateError if the request ended: pages stay its
            del plan.spare[: len(take)]
        if len(take) < count:
            take += self.cpu.allocate(count - len(take)) or []
        return take

    def _locate_each(self, rest: ChunkSpans, lease: Lease[LookupPlan]) -> list[ChunkHit]:
        """Chunk by chunk, every tier: where the CPU prefix ended (a lower-tier hit, or a
        CPU chunk after one)."""
        keys = rest.keys
        where: list[Tier | None] = [None] * len(rest)
        if self.cpu_visible:
            for i, present in enumerate(self.cpu.contains(keys)):
                if present:
                    where[i] = self.cpu
        for tier in self.lower:
            missing = [i for i, w in enumerate(where) if w is None]
            if not missing:
                break
            try:
                answers = tier.contains([keys[i] for i in missing])
            except KVTierError as exc:
                log.warning("tier %s lookup failed, counting it as a miss: %s", tier.name, exc)
                continue
            for i, present in zip(missing, answers, strict=True):
                if present:
                    where[i] = tier
        prefix = _prefix_len(where)
        return self._pin(rest[:prefix], where[:prefix], lease)

    def _pin(
        self, spans: Sequence[ChunkSpan], where: Sequence[Tier | None], lease: Lease[LookupPlan]
    ) -> list[ChunkHit]:
        """Pin each located chunk in order; stop at the first that vanished meanwhile. A run
        of chunks in one lower tier is pinned with one ``pin_many`` and held by one hold (a
        1M-token prompt is 4,096 chunks: one hold each cost more than the lookup itself)."""
        hits: list[ChunkHit] = []
        all_keys = spans.keys if isinstance(spans, ChunkSpans) else [s.key for s in spans]
        cpu_run = [k for k, w in zip(all_keys, where, strict=True) if w is self.cpu]
        if not self.cpu.resident:  # a coded CPU tier: pinned by key and loaded as a lower one
            cpu_run = []
        cpu_entries = self.cpu.pin_keys(cpu_run) if cpu_run else {}
        lease.take_pages([e.page for e in cpu_entries.values()])
        i = 0
        while i < len(spans):
            tier = where[i]
            assert tier is not None
            if tier is self.cpu and self.cpu.resident:
                entry = cpu_entries.get(spans[i].key)
                if entry is None:
                    break
                hits.append(ChunkHit(spans[i], self.cpu, entry.page))
                i += 1
                continue
            end = i + 1
            while end < len(spans) and where[end] is tier:
                end += 1
            run = spans[i:end]
            keys = all_keys[i:end]
            pinned = tier.pin_many(keys)
            if pinned:
                held = keys[:pinned]
                lease.take_hold(
                    CallbackHold(
                        0,
                        f"{tier.name} pin {held[0].hex()}"
                        + (f" and {pinned - 1} more" if pinned > 1 else ""),
                        _unpinner(tier, held),
                    )
                )
                hits.extend(ChunkHit(span, tier) for span in run[:pinned])  # one span each
            if pinned < len(keys):
                break
            i = end
        return hits

    # -- retrieve --------------------------------------------------------------------------
    def load(
        self,
        plan: LookupPlan,
        lease: Lease[LookupPlan],
        out: torch.Tensor | None,
        start_token: int,
    ) -> int:
        """Copy the plan's chunks from ``start_token`` on into ``out`` (indexed by absolute
        token position). Returns the end of what was loaded: a lower-tier miss or no free page
        ends the hit early, and the engine recomputes from there. ``out=None`` only makes the
        chunks resident in pages the lease holds (``hit.page``), for a reader that maps them."""
        loaded_end = 0
        # A tier whose chunks are already in memory serves straight into out (one copy, its
        # check fused with it), unless the chunk is to be copied back to the CPU tier anyway
        # or its page is packed by group (a trimmed group's tokens must be unpacked).
        direct = (
            out is not None
            and out.device.type == "cpu"
            and not self.promote_to_cpu
            and not self.layout.trims
        )
        self._prefetch(plan, lease, start_token, direct)
        for hit in plan.hits:
            span = hit.span
            if hit.tier is not ENGINE and span.end > start_token:
                if hit.failed:
                    break
                if direct and hit.page is None and hit.tier.serves_views:
                    assert out is not None
                    if not self._read_into(hit, hit.tier, out):
                        break
                else:
                    if hit.page is None and not self._fetch(hit, hit.tier, plan, lease):
                        break
                    assert hit.page is not None
                    if out is not None:
                        self._copy_out(hit.page, span, out)
                        if not self.cpu.resident:
                            # The page was only this chunk's staging (the coded CPU tier took
                            # its own copy, if any): the next chunk reuses it (held by the
                            # lease still), and a later load of this one reads it again.
                            plan.spare.append(hit.page)
                            hit.page = None
                self.counters.count_hit(hit.tier.name, span.num_tokens)
            loaded_end = span.end
        # Chunks after a failed fetch are no longer usable: drop them from the plan.
        plan.hits = [h for h in plan.hits if h.span.end <= loaded_end]
        return loaded_end

    def _prefetch(
        self, plan: LookupPlan, lease: Lease[LookupPlan], start_token: int, direct: bool
    ) -> None:
        """Read the plan's lower-tier chunks with one ``get_many_into`` per tier (the disk
        tier overlaps the reads, a remote tier pipelines them). Hits that fail are marked
        ``failed`` (``load`` stops there); when pages are short, ``_fetch`` reads one by one.
        With ``direct``, tiers that serve views are left to ``load``."""
        todo: dict[Tier, list[ChunkHit]] = {}
        for hit in plan.hits:
            tier = hit.tier
            if tier is ENGINE or tier is self.cpu or hit.page is not None:
                continue  # a coded CPU tier's chunks: one by one in load, recycling a page
            if direct and tier.serves_views:
                continue
            if hit.span.end > start_token:
                todo.setdefault(tier, []).append(hit)
        for tier, hits in todo.items():
            if len(hits) < 2:
                continue
            pages = self._load_pages(plan, lease, len(hits))
            hits = hits[: len(pages)]  # the rest are read one by one (_fetch)
            if len(pages) < 2:
                self.pool.release(pages)
                continue
            try:
                views = [self.pool.page_bytes_view(p) for p in pages]
                items = [(h.span.key, v) for h, v in zip(hits, views, strict=True)]
                results = tier.get_many_into(items)
            except ReadAbandoned as exc:
                log.warning("tier %s batch read timed out: %s", tier.name, exc)
                for i, page in enumerate(pages):
                    if i in exc.busy:
                        self._park(page, exc.busy[i])
                    else:
                        self.pool.release([page])
                continue
            except KVTierError as exc:
                log.warning("tier %s batch read failed, reading one by one: %s", tier.name, exc)
                self.pool.release(pages)
                continue
            for i, (hit, page, tokens) in enumerate(zip(hits, pages, results, strict=True)):
                if tokens != hit.span.num_tokens:
                    self.pool.release([page])
                    self.counters.add(load_failures=1)
                    hit.failed = True
                    continue
                try:
                    self._adopt(hit, page, lease)
                except StateError:
                    # The request ended meanwhile: _adopt gave this page back; give back the
                    # rest of the batch too, then let the caller see the error.
                    self.pool.release(pages[i + 1 :])
                    raise

    def _fetch(self, hit: ChunkHit, tier: Tier, plan: LookupPlan, lease: Lease[LookupPlan]) -> bool:
        """Read ``hit``'s chunk from ``tier`` (a lower one) into a page (reserved at lookup,
        else a fresh one) that ``lease`` then holds."""
        pages = self._load_pages(plan, lease, 1)
        if not pages:
            log.warning("no free CPU page to load a %s hit into; recomputing from here", tier.name)
            self.counters.add(load_failures=1)
            return False
        page = pages[0]
        try:
            tokens = tier.get_into(hit.span.key, self.pool.page_bytes_view(page))
        except ReadAbandoned as exc:
            log.warning("tier %s read timed out, counting it as a miss: %s", tier.name, exc)
            self._park(page, exc.busy[0])
            self.counters.add(load_failures=1)
            return False
        except KVTierError as exc:
            log.warning("tier %s read failed, counting it as a miss: %s", tier.name, exc)
            tokens = None
        except BaseException:
            self.pool.release(pages)  # a tier bug must not also leak the page
            raise
        if tokens != hit.span.num_tokens:
            self.pool.release(pages)
            self.counters.add(load_failures=1)
            return False
        self._adopt(hit, page, lease)
        return True

    def _read_into(self, hit: ChunkHit, tier: Tier, out: torch.Tensor) -> bool:
        """Read ``hit``'s chunk from ``tier`` (one that ``serves_views``) straight into its
        rows of ``out``; False on a miss (those rows may then hold garbage)."""
        span = hit.span
        try:
            tokens = tier.get_into(span.key, out[:, :, span.start : span.end, :])
        except KVTierError as exc:
            log.warning("tier %s read failed, counting it as a miss: %s", tier.name, exc)
            tokens = None
        if tokens != span.num_tokens:
            self.counters.add(load_failures=1)
            return False
        return True

    def _park(self, page: int, read: Future[Any]) -> None:
        """A read that timed out may still write into ``page``: it stays allocated (owned as
        I/O in flight, like a write's page) until the read stops, then goes back."""
        self.writes_in_flight.open(page)

        def done(_: Future[Any]) -> None:
            # AssertionError: the engine closed meanwhile, and the pool is gone anyway.
            with contextlib.suppress(AssertionError):
                self.writes_in_flight.close(page, self.pool)

        read.add_done_callback(done)

    def _adopt(self, hit: ChunkHit, page: int, lease: Lease[LookupPlan]) -> None:
        """A page just filled from a lower tier: the lease takes the caller's reference, and
        the CPU index one more when disk/remote hits are copied back (``promote_to_cpu``)."""
        if self.promote_to_cpu:
            self.pool.retain([page])  # one reference for the cache entry, one for the lease
            if not self.cpu.insert(hit.span.key, page, hit.span.num_tokens):
                self.pool.release([page])
        lease.take_pages([page])
        hit.page = page

    def _copy_out(self, page: int, span: ChunkSpan, out: torch.Tensor) -> None:
        lay = self.layout
        src = self.pool.page_bytes_view(page, lay.payload_bytes(span.num_tokens))
        lay.unpack(src, out[:, :, span.start : span.end, :])

    # -- store -----------------------------------------------------------------------------
    def store(self, spans: Sequence[ChunkSpan], kv: torch.Tensor) -> tuple[int, int]:
        """Copy each chunk not yet held into a page and hand it to the tiers that lack it.
        Returns (chunks newly stored somewhere, chunks dropped). When no page can be freed,
        the rest is dropped (counted): a store never waits. A coded CPU tier's pages are only
        staging (``CpuTier.resident`` false): there the chunks go through in batches of what
        the pool holds, each batch's pages back in the pool before the next is reserved."""
        step = len(spans) if self.cpu.resident else max(1, self.pool.num_pages // 2)
        if not self.cpu.resident and self.cpu_visible and spans:  # evict before the inserts
            self.cpu.make_room(self.cpu.contains([s.key for s in spans]).count(False))
        stored = dropped = 0
        for at in range(0, len(spans), max(step, 1)):
            slots, dropped = self.reserve(spans[at : at + step])
            pages = [slot.page for slot in slots]
            try:
                for slot in slots:
                    self._copy_in(kv, slot.span, slot.page)
                stored += self.commit(slots)
            finally:
                self.pool.release(pages)  # the reservation's own references (owners took theirs)
            if dropped:  # no page for the rest either: counted as dropped too
                rest = max(0, len(spans) - at - step)
                self.counters.add(dropped_chunks=rest)
                dropped += rest
                break
        return stored, dropped

    def reserve(self, spans: Sequence[ChunkSpan]) -> tuple[list[StoreSlot], int]:
        """A page for each chunk some tier lacks, each with one reference for the caller.
        Returns (slots, chunks dropped): when no page can be freed, the rest is dropped and
        counted. Fill the pages, :meth:`commit` them, then release the caller's references;
        releasing without a commit gives the pages back unstored."""
        if not spans:
            return [], 0
        keys = [s.key for s in spans]
        cpu_has = self.cpu.contains(keys) if self.cpu_visible else [True] * len(keys)
        lower_has = [self._contains_or_none(tier, keys) for tier in self.lower]
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
            slots.append(StoreSlot(span, pages[0], writers, to_cpu))
        self.counters.add(dropped_chunks=dropped)
        return slots, dropped

    def commit(self, slots: Sequence[StoreSlot]) -> int:
        """Hand each filled page to its owners (the CPU index, each lower-tier write), each
        taking a reference of its own; the caller keeps (and later releases) its reservation's.
        Returns the chunks newly stored."""
        for slot in slots:
            self._hand_out(slot.span, slot.page, slot.to_cpu, slot.writers)
        self.counters.add(stored_chunks=len(slots))
        return len(slots)

    def _hand_out(self, span: ChunkSpan, page: int, to_cpu: bool, writers: list[Tier]) -> None:
        """Give the CPU index and each lower-tier write a reference to ``page`` of its own."""
        if to_cpu:
            self.pool.retain([page])
            if not self.cpu.insert(span.key, page, span.num_tokens):
                self.pool.release([page])  # raced with another store of the same key
        payload = self.pool.page_bytes_view(page, self.layout.payload_bytes(span.num_tokens))
        for tier in writers:
            self.pool.retain([page])
            ticket = WriteTicket(self.writes_in_flight, self.pool, self.counters, tier, page)
            try:
                tier.put(span.key, payload, span.num_tokens, ticket)
            except Exception as exc:  # put must report through on_done; if it raised
                # instead, complete the ticket here so its page reference comes back.
                log.error("tier %s put raised instead of completing: %s", tier.name, exc)
                ticket(PutResult(span.key, PutOutcome.FAILED, str(exc)))

    def _contains_or_none(self, tier: Tier, keys: list[ChunkKey]) -> list[bool] | None:
        try:
            return tier.contains(keys)
        except KVTierError as exc:
            log.warning("tier %s is unavailable, not writing to it: %s", tier.name, exc)
            return None

    def _copy_in(self, kv: torch.Tensor, span: ChunkSpan, page: int) -> None:
        lay = self.layout
        dst = self.pool.page_bytes_view(page, lay.payload_bytes(span.num_tokens))
        lay.pack(kv[:, :, span.start : span.end, :], dst)

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


def _geometry(spans: Sequence[ChunkSpan]) -> tuple[int, int, int]:
    """(chunk_size, num_tokens, first index) of a plain list of consecutive spans."""
    if not spans:
        return 1, 0, 0
    first = spans[0]
    size = first.end - first.start if len(spans) == 1 else spans[1].start - first.start
    return max(size, 1), spans[-1].end, first.index


def _prefix_len(where: Sequence[object | None]) -> int:
    for i, w in enumerate(where):
        if w is None:
            return i
    return len(where)


def _unpinner(tier: Tier, keys: list[ChunkKey]) -> Callable[[], None]:
    return lambda: tier.unpin_many(keys)
