"""A store's pages on their way to the tiers: the slots a store reserves, and the page
references lower-tier writes hold until their completion callback gives them back.

Each lower-tier write of a stored chunk owns one reference to the chunk's page through a
:class:`WriteTicket`; the tier calls the ticket exactly once (``on_done``, also on failure),
which releases that reference. :class:`WritesInFlight` counts those references per page so
that the reference audit can name an owner for each while writes are still landing.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from kvtier.keys import ChunkSpan
from kvtier.memory.block_pool import BlockPool
from kvtier.storage.base import PutResult, Tier
from kvtier.storage.counters import EngineCounters

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StoreSlot:
    """One chunk a store will write: its page (reserved, not yet visible) and its owners-to-be."""

    span: ChunkSpan
    page: int
    writers: list[Tier]  # lower tiers that lack the chunk
    to_cpu: bool  # the CPU index lacks it (and is visible)
    tenant: str | None = None  # the storing request's cache_salt (tenant_quotas)


class WriteTicket:
    """Owns one page reference for one lower-tier write; gives it back exactly once."""

    __slots__ = ("_done", "_lock", "counters", "page", "pool", "tier", "writes")

    def __init__(
        self,
        writes: WritesInFlight,
        pool: BlockPool,
        counters: EngineCounters,
        tier: Tier,
        page: int,
    ) -> None:
        self.writes = writes
        self.pool = pool
        self.counters = counters
        self.tier = tier
        self.page = page
        self._done = False
        self._lock = threading.Lock()
        writes.open(page)

    def __call__(self, result: PutResult) -> None:
        with self._lock:
            if self._done:
                log.error("tier %s completed a write twice; ignoring the second", self.tier.name)
                return
            self._done = True
        self.writes.close(self.page, self.pool)
        self.counters.count_write(self.tier.name, result.outcome)


class WritesInFlight:
    """Page references held by lower-tier I/O in flight (writes, and reads that timed out
    but still run), counted so that an invariant check can account for every reference
    even while they are still landing."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_page: dict[int, int] = {}

    def open(self, page: int) -> None:
        with self.lock:
            self.by_page[page] = self.by_page.get(page, 0) + 1

    def close(self, page: int, pool: BlockPool) -> None:
        # Release under the lock: a checker holding it sees the count and the refcount agree.
        with self.lock:
            left = self.by_page[page] - 1
            if left:
                self.by_page[page] = left
            else:
                del self.by_page[page]
            pool.release([page])
