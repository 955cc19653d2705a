"""The lookup: the longest prefix of a request's chunks that the engine or some tier holds,
pinned for the request in its lease (``PrefixLookup.locate``, making a :class:`LookupPlan`).

Chunk ``i`` counts only if chunks ``0..i-1`` count, and a chunk counts when *some* tier holds
it::

    chunk:     0    1    2    3    4
    cpu:       x    .    x    .    x
    disk:      .    x    .    .    x
    counts:    x    x    x    .    .      -> hit = 3 chunks (3 is nowhere, so 4 cannot count)

Every counted chunk is pinned for the request in its lease: a CPU page reference, or a pin on
the lower-tier entry (a tier that cannot pin, such as a shared remote store, may still miss
at retrieve; the hit then ends there and the engine recomputes the rest).

A lower-tier chunk is read into a CPU page at load time (:mod:`kvtier.storage.loads`), so the
lookup also reserves one free page per lower-tier chunk of the hit (``LookupPlan.spare``, held
by the lease): a hit is never promised that cannot get a page to load into. When the pages run
out the hit ends before the first lower-tier chunk without one (declined now, rather than
failing at load).

The plan it makes
-----------------
What a lookup found: the pinned hit prefix as runs of chunks per tier (:class:`LookupPlan`).

The storage manager makes a plan at lookup (``StorageManager.locate``) and keeps it in the
request's lease; the engine loads from it and reports it, and no one outside the engine sees
it (the engine answers a lookup with a ``Hit``). A plan over five chunks, three hit::

    chunk:   0        1        2        3    4
    source:  ENGINE   cpu      disk     .    .     runs: (ENGINE, 0, 1), (cpu, 1, 2),
                                                          (disk, 2, 3)
    cpu_tokens: the end of chunk 1 (the leading run that loads without a lower tier)
    hit_tokens: the end of chunk 2
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.errors import KVTierError
from kvtier.keys import ChunkKey, ChunkSpan, ChunkSpans
from kvtier.lease import CallbackHold, Lease
from kvtier.storage.base import Tier
from kvtier.storage.cpu import CpuTier

log = logging.getLogger(__name__)


class Skipped(enum.Enum):
    """Where a chunk inside ``skip_leading_tokens`` is: the engine's caller already holds it,
    so it is hashed, never loaded. A typed sentinel beside the tiers (``hit.tier is ENGINE``);
    its ``name`` is ``"engine"``, so reports can name a hit's source the same way for both."""

    engine = "engine"


ENGINE = Skipped.engine
Source = Tier | Skipped  # where a hit's bytes are: a tier, or already with the caller


@dataclass(slots=True)
class ChunkHit:
    span: ChunkSpan
    tier: Source
    page: int | None = None  # set once the chunk's bytes are in a page this request holds
    failed: bool = False  # a batched read of this chunk missed: the hit ends here


class LookupPlan:
    """The hit prefix of one lookup, pinned in the request's lease.

    Kept as runs of chunks per tier (``runs``: tier, first chunk, end chunk) plus the CPU
    pages, because a lookup of a long cached prompt must not build an object per chunk; the
    per-chunk :class:`ChunkHit` list is made on first use of :attr:`hits` (by a retrieve,
    where each chunk is copied anyway).
    """

    __slots__ = ("_hits", "_pages", "keys", "runs", "spans", "spare")

    def __init__(
        self,
        spans: ChunkSpans,
        runs: list[tuple[Source, int, int]],
        pages: list[int | None],
        hits: list[ChunkHit] | None = None,
        spare: list[int] | None = None,
    ) -> None:
        self.spans = spans
        self.keys: tuple[ChunkKey, ...] = tuple(spans.keys)
        self.runs = runs  # (tier, first chunk, end chunk), consecutive from chunk 0
        self._pages = pages  # by chunk: the CPU page the lease holds for it, or None
        self._hits = hits
        # Free pages the lease holds for this plan's lower-tier chunks to be read into.
        self.spare: list[int] = spare if spare is not None else []

    @property
    def cpu_tokens(self) -> int:
        """The end of the hit's leading run in the CPU tier (or held by the engine): what
        loads without reading a lower tier."""
        end = 0
        for tier, _, last in self.runs:
            if tier is not ENGINE and not isinstance(tier, CpuTier):
                break
            end = last
        return self.spans.end(end - 1) if end else 0

    @property
    def hit_chunks(self) -> int:
        return self.runs[-1][2] if self.runs else 0

    @property
    def hit_tokens(self) -> int:
        if self._hits is not None:
            return self._hits[-1].span.end if self._hits else 0
        n = self.hit_chunks
        return self.spans.end(n - 1) if n else 0

    def extended(self, spans: ChunkSpans, tail: LookupPlan) -> LookupPlan:
        """This plan's hit followed by ``tail``'s, a plan of the chunks right after it (a
        checkpoint: :mod:`kvtier.engine._checkpoints`), over ``spans``, the keys of both."""
        shift = self.hit_chunks
        runs = self.runs + [(tier, first + shift, end + shift) for tier, first, end in tail.runs]
        pages = self._pages[:shift] + tail._pages
        return LookupPlan(spans, runs, pages, spare=self.spare + tail.spare)

    @property
    def hits(self) -> list[ChunkHit]:
        if self._hits is None:
            spans, pages = self.spans, self._pages
            self._hits = [
                ChunkHit(spans[i], tier, pages[i] if i < len(pages) else None)
                for tier, first, end in self.runs
                for i in range(first, end)
            ]
        return self._hits

    @hits.setter
    def hits(self, hits: list[ChunkHit]) -> None:
        self._hits = hits
        first = self.spans.first
        self.runs = [(h.tier, h.span.index - first, h.span.index - first + 1) for h in hits]


class PrefixLookup:
    """Finds and pins hit prefixes across the CPU tier and the lower tiers, in that order.
    ``cpu_visible`` false: the CPU tier is only staging (its index is never looked in).
    ``lower`` is the manager's own list of lower tiers, shared rather than copied."""

    def __init__(self, cpu: CpuTier, lower: Sequence[Tier], *, cpu_visible: bool) -> None:
        self.cpu = cpu
        self.lower = lower
        self.cpu_visible = cpu_visible

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
        (``PlanLoader.load``): with one reserved the whole hit is promised (a reader of pages,
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
