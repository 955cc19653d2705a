"""What a lookup found: the pinned hit prefix as runs of chunks per tier (:class:`LookupPlan`).

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
from dataclasses import dataclass

from kvtier.keys import ChunkKey, ChunkSpan, ChunkSpans
from kvtier.storage.base import Tier
from kvtier.storage.cpu import CpuTier


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
