"""The load: a lookup's plan copied into the caller's tensor, or made resident in CPU pages
(``PlanLoader.load``).

A CPU-tier chunk is copied out of its page. A lower-tier chunk is read into a CPU page first
(one reserved at lookup, :mod:`kvtier.storage.lookup`), the reads of one tier batched into one
``get_many_into``; with ``promote_to_cpu`` the page then joins the CPU index too. A tier whose
chunks are already in memory (``Tier.serves_views``: the PD buffer) is read straight into the
caller's tensor instead, its check fused with that one copy, when the caller gives one and
the chunk is not to be copied back to the CPU tier; the page reserved for it stays unused.

A read that fails or misses ends the hit there: the engine recomputes from that token.

The copies out of pages into a device tensor are one batch of the device-copy owner
(:mod:`kvtier.memory.device`); they may still run when ``load`` returns, so their fence goes to
the lease, which waits on it before it gives the pages back. A page reused within the load (a
coded CPU tier's staging page) is reused only after its copy landed.
"""

from __future__ import annotations

import contextlib
import logging
from concurrent.futures import Future
from typing import Any

import torch

from kvtier.errors import KVTierError, StateError
from kvtier.keys import ChunkSpan
from kvtier.layout import KVLayout
from kvtier.lease import Lease
from kvtier.memory.block_pool import BlockPool
from kvtier.memory.device import CopyBatch, CopyEngine, Direction
from kvtier.storage.base import ReadAbandoned, Tier
from kvtier.storage.counters import EngineCounters
from kvtier.storage.cpu import CpuTier
from kvtier.storage.lookup import ENGINE, ChunkHit, LookupPlan
from kvtier.storage.writes import WritesInFlight

log = logging.getLogger(__name__)


class PlanLoader:
    """Loads lookup plans out of the CPU pool and the lower tiers. ``promote_to_cpu``: a chunk
    read from a lower tier is copied back into the CPU index (``Config.local_cpu``). A read
    that times out parks its page in ``writes_in_flight`` until the read stops."""

    def __init__(
        self,
        layout: KVLayout,
        pool: BlockPool,
        cpu: CpuTier,
        counters: EngineCounters,
        writes_in_flight: WritesInFlight,
        copies: CopyEngine,
        *,
        promote_to_cpu: bool,
    ) -> None:
        self.layout = layout
        self.pool = pool
        self.cpu = cpu
        self.counters = counters
        self.writes_in_flight = writes_in_flight
        self.copies = copies
        self.promote_to_cpu = promote_to_cpu

    def load(
        self,
        plan: LookupPlan,
        lease: Lease[LookupPlan],
        out: torch.Tensor | None,
        start_token: int,
        base: int = 0,
    ) -> int:
        """Copy the plan's chunks from ``start_token`` on into ``out``, whose row 0 is token
        ``base`` (a chunk start at or before ``start_token``: a buffer as long as the load, not
        the prompt). Returns the end of what was loaded: a lower-tier miss or no free page
        ends the hit early, and the engine recomputes from there. ``out=None`` only makes the
        chunks resident in pages the lease holds (``hit.page``), for a reader that maps them."""
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
        batch = self.copies.begin(out, Direction.LOAD) if out is not None else None
        try:
            loaded_end = self._copy_hits(plan, lease, out, batch, start_token, base, direct)
        finally:
            if batch is not None:
                lease.copying(batch.close())  # the pages go back only once it landed
        # Chunks after a failed fetch are no longer usable: drop them from the plan.
        plan.hits = [h for h in plan.hits if h.span.end <= loaded_end]
        return loaded_end

    def _copy_hits(
        self,
        plan: LookupPlan,
        lease: Lease[LookupPlan],
        out: torch.Tensor | None,
        batch: CopyBatch | None,
        start_token: int,
        base: int,
        direct: bool,
    ) -> int:
        """``load``'s walk over the plan: the end of what was copied into ``out``."""
        loaded_end = 0
        for hit in plan.hits:
            span = hit.span
            if hit.tier is not ENGINE and span.end > start_token:
                if hit.failed:
                    break
                if direct and hit.page is None and hit.tier.serves_views:
                    assert out is not None
                    if not self._read_into(hit, hit.tier, out, base):
                        break
                else:
                    if hit.page is None and not self._fetch(hit, hit.tier, plan, lease):
                        break
                    assert hit.page is not None
                    if out is not None and self.cpu.resident:
                        assert batch is not None
                        self._copy_out(hit.page, span, out, batch, base)
                    elif out is not None:
                        # A staging page: the next chunk writes it again, so its copy lands
                        # first (a batch of its own).
                        one = self.copies.begin(out, Direction.LOAD)
                        self._copy_out(hit.page, span, out, one, base)
                        one.close().wait()
                        # The page was only this chunk's staging (the coded CPU tier took its
                        # own copy, if any): the next chunk reuses it (held by the lease
                        # still), and a later load of this one reads it again.
                        plan.spare.append(hit.page)
                        hit.page = None
                self.counters.count_hit(hit.tier.name, span.num_tokens)
                if hit.tier is self.cpu and self.cpu.resident:
                    # Served from the page its lookup pinned, not through get_into (which
                    # counts for itself): the CPU tier's own counters (/stats) count it here.
                    self.cpu.count_served(span.num_tokens)
            loaded_end = span.end
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

    def _read_into(self, hit: ChunkHit, tier: Tier, out: torch.Tensor, base: int) -> bool:
        """Read ``hit``'s chunk from ``tier`` (one that ``serves_views``) straight into its
        rows of ``out``; False on a miss (those rows may then hold garbage)."""
        span = hit.span
        try:
            tokens = tier.get_into(span.key, out[:, :, span.start - base : span.end - base, :])
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

    def _copy_out(
        self, page: int, span: ChunkSpan, out: torch.Tensor, batch: CopyBatch, base: int
    ) -> None:
        lay = self.layout
        src = self.pool.page_bytes_view(page, lay.payload_bytes(span.num_tokens))
        lay.unpack(src, out[:, :, span.start - base : span.end - base, :], batch.copy)

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
