"""The worker side of the connector (runs in each vLLM worker process): it owns the Engine.

Lifecycle::

    register(kv_caches)   read the paged layout, open the Engine, open the lookup channel
    load(meta)            before the forward: kvtier pages -> the request's vLLM blocks
    save(meta)            after the forward: whole new chunks of prompts -> kvtier (not for
                          a request whose load this step came up short: its forward used
                          unfilled blocks, and vLLM recomputes it)
    failed_blocks()       blocks a load could not fill (a chunk that failed its checksum or
                          vanished from a lower tier): vLLM recomputes them
    close()               channel closed, Engine closed (ends every lease, drains writes)

Who touches the Engine: the lookup channel's threads (lookup, end, stats) and vLLM's model
thread (load, save). One lock serialises them; the scheduler never asks while a step runs on
CPU (vLLM schedules the next step after this one returns), so the lock is uncontended there.

A load for a request whose lease has ended (an abort that overtook the step) is skipped and
its blocks reported as failed: a retrieve would otherwise open a fresh lease nobody ends.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

import torch

from kvtier.config import Config
from kvtier.engine import Engine
from kvtier.errors import InputError, KVTierError, StateError
from kvtier.integrations.vllm.channel import LookupServer
from kvtier.integrations.vllm.events import MEDIUM, EventLog, chain_evictions
from kvtier.integrations.vllm.metadata import KVTierMetadata
from kvtier.integrations.vllm.metrics import CounterDeltas
from kvtier.integrations.vllm.paged import PagedKV
from kvtier.integrations.vllm.pd import PDLink

log = logging.getLogger(__name__)


class WorkerSide:
    def __init__(
        self,
        config: Config,
        *,
        model_name: str,
        engine_id: str,
        tp_rank: int,
        tp_world_size: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        events: bool = False,
    ) -> None:
        self.config = config
        self.model_name = model_name
        self.engine_id = engine_id
        self.tp_rank = tp_rank
        self.tp_world_size = tp_world_size
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.engine: Engine | None = None
        self.paged: PagedKV | None = None
        self._server: LookupServer | None = None
        self._lock = threading.Lock()
        self._live: set[str] = set()  # requests with a lease: looked up, not ended
        self._failed: set[int] = set()
        self._short: dict[str, int] = {}  # request -> tokens its load delivered, this step
        self._scratch: torch.Tensor | None = None
        # Only rank 0 reports events: every rank stores the same chunks (its own slice).
        self.events = EventLog() if events and tp_rank == 0 else None
        self._media: list[str] = []
        self._pd: PDLink | None = None
        self._deltas = CounterDeltas()

    # -- lifecycle -------------------------------------------------------------------------
    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        paged = PagedKV.from_vllm(
            kv_caches,
            block_size=self.block_size,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
        )
        engine = Engine(
            self.config,
            paged.layout(),
            model_name=self.model_name,
            tp_rank=self.tp_rank,
            tp_world_size=self.tp_world_size,
        ).open()
        self.paged, self.engine = paged, engine
        self._media = [MEDIUM[name] for name in MEDIUM if engine.tier(name) is not None]
        if self.events is not None:
            for name in ("cpu", "disk"):
                tier = engine.tier(name)
                if tier is not None:
                    chain_evictions(tier, MEDIUM[name], self.events)
        self._pd = PDLink(engine, self.tp_rank)
        self._server = LookupServer(self.engine_id, self.tp_rank, self._handle).open()
        log.info(
            "kvtier worker %d: %s, channel %s", self.tp_rank, paged.describe(), self._server.path
        )

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._pd is not None:
            self._pd.close()
            self._pd = None
        with self._lock:
            if self.engine is not None:
                self.engine.close()
            self._live.clear()

    # -- the step --------------------------------------------------------------------------
    def load(self, meta: KVTierMetadata) -> None:
        engine, paged = self._parts()
        for spec in meta.loads:
            loaded = spec.start
            out = self._scratch_for(len(spec.tokens))
            with self._lock:
                if spec.request_id not in self._live:
                    log.warning("kvtier: load for ended request %s skipped", spec.request_id)
                else:
                    try:
                        hit = engine.retrieve_into(
                            spec.tokens, spec.request_id, out, skip_leading_tokens=spec.start
                        )
                        loaded = max(spec.start, min(hit, spec.end))
                    except KVTierError as exc:  # a tier failed outright: recompute it all
                        log.warning("kvtier: load for %s failed: %s", spec.request_id, exc)
            if loaded > spec.start:
                paged.scatter(spec.block_ids, spec.start, loaded, out)
            if loaded < spec.end:
                self._short[spec.request_id] = loaded
                # vLLM recomputes from the first failed block on: report every block of the
                # range from the one holding the first token that did not arrive.
                first, last = loaded // self.block_size, -(-spec.end // self.block_size)
                self._failed.update(spec.block_ids[first:last])
                log.warning(
                    "kvtier: request %s loaded %d of %d tokens; vLLM recomputes the rest",
                    spec.request_id,
                    loaded - spec.start,
                    spec.end - spec.start,
                )

    def save(self, meta: KVTierMetadata) -> None:
        if not meta.saves:
            return
        engine, paged = self._parts()
        for spec in meta.saves:
            if spec.request_id in self._short:
                # This step computed the request on top of blocks its load could not fill:
                # vLLM throws that away and recomputes, and so must kvtier (never store KV
                # that attended to garbage). The scheduler re-offers the chunks later.
                continue
            out = self._scratch_for(spec.end)
            paged.gather(spec.block_ids, spec.start, spec.end, out)
            with self._lock:
                engine.store(spec.tokens, out[:, :, : spec.end], skip_leading_tokens=spec.start)
            if self.events is None and spec.transfer_id is None:
                continue
            spans = engine.keychain.keys(spec.tokens, include_partial=False)
            first = spec.start // engine.config.chunk_size
            if spec.transfer_id is not None and self._pd is not None:
                self._pd.send(spec.transfer_id, spans[first:], out)
            if self.events is not None:
                parent = spans[first - 1].key if first else None
                self.events.stored(spans[first:], parent, spec.tokens, self._media)

    def failed_blocks(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed

    def take_events(self) -> list[tuple[Any, ...]]:
        return self.events.drain() if self.events is not None else []

    def counter_deltas(self) -> dict[str, int]:
        """The Engine's counters' increase since the last call (for vLLM's /metrics)."""
        if self.engine is None:
            return {}
        return self._deltas.take(self.engine.counters.as_dict())

    def short_loads(self) -> dict[str, int]:
        """Requests whose load this step came up short (called once per step, after save)."""
        short, self._short = self._short, {}
        return short

    # -- the lookup channel ----------------------------------------------------------------
    def _handle(self, op: str, args: tuple[Any, ...]) -> Any:
        engine, _ = self._parts()
        with self._lock:
            if op == "lookup":
                rid, tokens = args
                hit = engine.lookup(tokens, rid)
                self._live.add(rid)
                return hit
            if op == "end":
                (rid,) = args
                self._live.discard(rid)
                return engine.end_request(rid)
            if op == "stats":
                return engine.stats()
            if op == "leaks":
                return [(i.request_id, i.pinned_pages, list(i.holds)) for i in engine.leaks()]
            if op == "check":
                return engine.check_invariants()
            if op == "flush":
                return engine.flush(*args)
            if op == "clear":
                return engine.clear()
        raise InputError(
            f"unknown kvtier channel op {op!r}; use lookup, end, stats, leaks, check, flush, clear"
        )

    # -- helpers ---------------------------------------------------------------------------
    def _parts(self) -> tuple[Engine, PagedKV]:
        if self.engine is None or self.paged is None:
            raise StateError("kvtier worker: vLLM has not registered its KV caches yet")
        return self.engine, self.paged

    def _scratch_for(self, tokens: int) -> torch.Tensor:
        """A reusable ``[2, layers, >=tokens, hidden]`` buffer: fresh memory is slow to touch,
        so it grows in whole chunks and is kept."""
        engine, paged = self._parts()
        layout = engine.layout
        if self._scratch is None or self._scratch.shape[2] < tokens:
            chunk = engine.config.chunk_size
            capacity = -(-tokens // chunk) * chunk
            self._scratch = torch.zeros(
                layout.kv_shape(capacity), dtype=layout.dtype, device=paged.layers[0].device
            )
        return self._scratch
