"""One copy between vLLM's paged blocks and kvtier's pages: the kernel reads and writes the
pages where they lie, with no device scratch.

The two-copy path moves every byte twice on a GPU: a load lands host pages in a device
window (``loads.py``) that torch then scatters into vLLM's blocks; a save gathers the blocks
into a device copy buffer (``copy_buffer.py``) that the store then copies to a page. Here the
Triton kernel (:mod:`.paged_kernel`) addresses the pinned pages directly (unified addressing),
through the engine's page API (``engine.pages()``, the one the kvtier server maps pages
with)::

    load   lease_pages(tokens, rid)   the hit's chunks, each resident in a page rid's lease
                                      holds: CPU-tier hits as they are, disk / Redis / S3 /
                                      P2P hits fetched into pages first (host to host)
           scatter(page -> blocks)    one launch per chunk, on the caller's stream (vLLM's
                                      forward, queued after it, reads the blocks in order)
           copying(rid, fence)        the lease gives the pages back only once it landed

    save   reserve_pages(tokens, sid) a page for each chunk no tier holds, under a store id
                                      of its own (``<rid>#save<n>``): commit ends it
           gather(blocks -> page)     one launch per chunk
           fence.wait(), commit       no host reader sees a page before the gather landed;
                                      behind the step on a GPU (:mod:`.save_drain`, which
                                      also keeps vLLM from freeing the blocks until then)

Streams: both directions launch on the caller's current stream, vLLM's. A load must run
there anyway (the forward reads the blocks next). A save's gather stays there for the reason
the two-copy path gathers there: no later kernel of vLLM's (a preempted request's blocks
reused) may overwrite the blocks before it read them. Its PCIe time is then on vLLM's stream,
where the two-copy path's device-to-host DMA overlapped the next step on kvtier's store
stream: one crossing instead of two and no scratch, against that overlap (the GPU check's
paged step measures both).

Which requests take it: an in-process engine (a server's pages are another process's memory,
not mapped for this device), no state layers and no trimmed group (the page is then the chunk
tensor ``[planes, layers, tokens, hidden]`` itself, see :mod:`kvtier.layout`), a kernel for
the layers that reaches the pages (pinned on CUDA). :meth:`OneCopy.build` decides once, at
register; ``force`` makes it take CPU tensors too (the kernel under ``TRITON_INTERPRET=1``:
how the tests prove the path without a GPU).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvtier.engine import Engine
from kvtier.errors import KVTierError
from kvtier.integrations.vllm.paged import PagedKV
from kvtier.keys import RequestKeys
from kvtier.memory.device import Landed
from kvtier.storage.cpu import CpuTier
from kvtier.storage.writes import StoreSlot

if TYPE_CHECKING:  # metadata imports vLLM: this module runs without it (the GPU checks)
    from kvtier.integrations.vllm.metadata import LoadSpec, SaveSpec
    from kvtier.integrations.vllm.save_drain import SaveDrain

log = logging.getLogger(__name__)


class OneCopy:
    """See the module docstring. Made by :meth:`build`; used by the model thread (sync
    loads, saves) and the loader thread (async loads)."""

    def __init__(
        self, engine: Engine, paged: PagedKV, fence: Callable[[], Landed] | None = None
    ) -> None:
        """``fence``: the fence after the launches queued so far (default: the kernel's; a
        test passes one it releases itself)."""
        assert paged.kernel is not None
        self.engine = engine
        self.paged = paged
        self.fence = fence if fence is not None else paged.kernel.fence
        self._pages = engine.pages()
        cpu = engine.tier("cpu")
        assert isinstance(cpu, CpuTier)
        self._pool = cpu.pool
        self._saves = 0  # store ids: one per save

    @classmethod
    def build(
        cls, engine: Engine | None, paged: PagedKV, *, states: bool, force: bool | None
    ) -> tuple[PagedKV, OneCopy | None]:
        """(the paged KV to use, the one-copy path or None). ``force``: True takes the path
        wherever it can work at all (CPU tensors too: the kernel must be importable, which on
        a CPU host means ``TRITON_INTERPRET=1``); False never; None where the KV is on CUDA,
        Triton is there and the pages are pinned."""
        if force is False or engine is None or states or engine.layout.trims:
            return paged, None
        if paged.kernel is None and force:
            paged = paged.with_kernel()
        kernel = paged.kernel
        if kernel is None:
            return paged, None
        cpu = engine.tier("cpu")
        if not isinstance(cpu, CpuTier) or not cpu.resident:
            return paged, None  # a coded CPU tier's pages are staging, read by its codec
        page = cpu.pool.page_bytes_view(0, engine.layout.dtype_bytes).view(engine.layout.dtype)
        if not kernel.reaches(page):
            log.info("kvtier: the CPU pages are not pinned; vLLM's blocks go through scratch")
            return paged, None
        return paged, cls(engine, paged)

    def page(self, page: int, tokens: int) -> torch.Tensor:
        """Page ``page`` as the chunk tensor of ``tokens`` tokens (a view, no copy)."""
        layout = self.engine.layout
        flat = self._pool.page_bytes_view(page, layout.payload_bytes(tokens))
        return flat.view(layout.dtype).view(layout.kv_shape(tokens))

    # -- loads -----------------------------------------------------------------------------
    def load(self, spec: LoadSpec, tables: Any) -> int:
        """Scatter ``spec``'s hit from its pages into vLLM's blocks (``tables``: the blocks
        :class:`PagedKV` addresses); the end of the usable load (``spec.start``: none). The
        copy may still run when this returns: the lease holds the pages until it landed, and
        work the caller queues on its stream next runs after it."""
        rid, pages = spec.request_id, self._pages
        with self.engine.loading(rid) as live:
            if not live:
                log.warning("kvtier: load for ended request %s skipped", rid)
                return spec.start
            try:
                hit, held = pages.lease_pages(
                    spec.tokens, rid, skip_leading_tokens=spec.start, cache_salt=spec.cache_salt
                )
            except KVTierError as exc:  # a tier failed outright: recompute all of it
                log.warning("kvtier: load for %s failed: %s", rid, exc)
                return spec.start
            loaded = max(spec.start, min(hit, spec.end))
            try:
                for page, first, tokens in held:
                    a, b = max(first, spec.start), min(first + tokens, loaded)
                    if a < b:
                        self.paged.scatter(tables, a, b, self.page(page, tokens), first)
            finally:
                # Before the block exits: an end of rid meanwhile releases the lease then.
                pages.copying(rid, self.fence())
        return loaded

    # -- saves -----------------------------------------------------------------------------
    def save(
        self,
        spec: SaveSpec,
        tables: Any,
        tokens: np.ndarray,
        keys: RequestKeys,
        drain: SaveDrain | None,
    ) -> None:
        """Gather ``spec``'s new chunks straight into reserved pages and commit them once the
        gather landed: behind the step through ``drain`` (it counts the save as copying out
        of the request's blocks until then), or now without one."""
        self._saves += 1
        store_id = f"{spec.request_id}#save{self._saves}"
        pages = self._pages
        try:
            slots = pages.reserve_pages(
                tokens,
                store_id,
                skip_leading_tokens=spec.start,
                cache_salt=spec.cache_salt,
                keys=keys,
            )
        except BaseException:
            self.engine.end_request(store_id)  # whatever it reserved goes back
            raise
        try:
            for slot in slots:
                span = slot.span
                page = self.page(slot.page, span.num_tokens)
                first = max(span.start, spec.start)
                self.paged.gather(tables, first, span.end, page, span.start)
        except BaseException:
            self.fence().wait()  # what was queued lands before the pages go back unstored
            self.engine.end_request(store_id)
            raise
        commit = partial(self._commit, spec, store_id, slots, self.fence())
        if drain is None:
            commit()
            return
        try:
            drain.submit(spec.request_id, commit, None)
        except BaseException:  # closed: nothing will commit, so the pages go back now
            self.fence().wait()
            self.engine.end_request(store_id)
            raise

    def _commit(
        self, spec: SaveSpec, store_id: str, slots: list[StoreSlot], landed: Landed
    ) -> None:
        """Hand the filled pages to the tiers once their gather landed; a failure gives them
        back unstored."""
        try:
            landed.wait()
            stored = self._pages.commit_pages(store_id, slots)
        finally:
            self.engine.end_request(store_id)  # commit ended it already; again is a no-op
        chunk = self.engine.config.chunk_size
        self.engine.record_stored(spec.request_id, stored * chunk, len(spec.tokens))
