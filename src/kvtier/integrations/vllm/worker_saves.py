"""Saves on the worker: a step's new whole chunks, out of vLLM's blocks into kvtier.

After the forward (``wait_for_save``), each save of the step's metadata is gathered out of
vLLM's blocks into a copy buffer and stored. Where the copies to kvtier's pages may land
late (KV on a device), the store runs behind the step (:mod:`.save_drain`) and :meth:`save`
returns before it lands; elsewhere it is stored before :meth:`save` returns. A save is
skipped, never half-stored, when its chunk cannot be whole::

    from_cache         a state model's PD prefiller's hit: its states are in kvtier (sent on)
    load came up short its forward used unfilled blocks: vLLM recomputes it, and so must we
    range incomplete   a sliding-window group already dropped blocks of this range
    no state kept      a state model with no checkpoint at the chunk's end

A PD prefiller's save (``transfer_id``) is stored and sent inside the step, on a GPU too:
the decoder looks it up as soon as the response leaves.

With ``use_layerwise`` (where loads go layer by layer too), the step's other saves leave the
blocks in vLLM's ``save_kv_layer`` hooks, one layer at a time (:mod:`.layerwise_saves`, held
to the same skip rules); :meth:`save` then only closes them, and saves whole-chunk the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch

from kvtier.cache import KVCache
from kvtier.engine import Engine
from kvtier.integrations.vllm.events import EventLog
from kvtier.integrations.vllm.layerwise import LayerLoads
from kvtier.integrations.vllm.layerwise_saves import LayerSaves
from kvtier.integrations.vllm.loads import Loads
from kvtier.integrations.vllm.metadata import KVTierMetadata, SaveSpec
from kvtier.integrations.vllm.one_copy import OneCopy
from kvtier.integrations.vllm.paged import PagedKV
from kvtier.integrations.vllm.pd import PDEndpoint
from kvtier.integrations.vllm.save_drain import SaveDrain
from kvtier.integrations.vllm.states import PagedState
from kvtier.keys import ChunkKey, ChunkSpan, RequestKeys
from kvtier.memory.device import CopyEngine
from kvtier.request_salt import ExtraKeys
from kvtier.tokens import as_token_array

Published = tuple[Sequence[ChunkSpan], ChunkKey | None]


@dataclass
class WorkerSaves:
    """The save path of one worker (module docstring); made when the worker opens."""

    cache: KVCache
    paged: PagedKV
    loads: Loads
    drain: SaveDrain
    late: bool  # copies out of vLLM's memory may land late: stores go behind the step
    scratch_for: Callable[[int], torch.Tensor]  # the model thread's copy buffer
    attention_tables: Callable[[Any], Any]
    states: PagedState | None = None
    events: EventLog | None = None
    engine: Engine | None = None  # in-process: tiers publish their own events
    pd: PDEndpoint | None = None  # a PD prefiller's sender
    media: Sequence[str] = ()  # where stores through a server are published
    one_copy: OneCopy | None = None  # saves gathered straight into kvtier's pages
    copies: CopyEngine | None = None  # with use_layerwise: the per-layer copies' engine
    layers: LayerSaves | None = field(default=None, init=False)  # use_layerwise's saves

    def __post_init__(self) -> None:
        cache, copies = self.cache, self.copies
        # Saves go layer by layer where loads can (one KV-cache group, no state layers).
        if cache.config.use_layerwise and copies and LayerLoads.serves(self.paged, self.loads):
            chunk = cache.config.chunk_size
            self.layers = LayerSaves(self, self.paged, cache.layout, chunk, self.drain, copies)

    def save_layer(self, layer_name: str, meta: KVTierMetadata) -> None:
        """After ``layer_name`` computed: its part of the step's saves (:mod:`.layerwise_saves`)."""
        if self.layers is not None and meta.saves:
            self.layers.layer(layer_name, meta)

    def stats(self) -> dict[str, int]:
        layers = self.layers
        return {
            "layerwise_saves": layers.saves if layers is not None else 0,
            "layerwise_save_skips": layers.skips if layers is not None else 0,
        }

    def save(self, meta: KVTierMetadata) -> None:
        cache, paged, chunk = self.cache, self.paged, self.cache.config.chunk_size
        # Saves that went layer by layer (stored or skipped there); the rest, whole chunks.
        layered = {id(s) for s in self.layers.close(meta)} if self.layers is not None else set()
        for spec in meta.saves:
            if id(spec) in layered:
                continue
            if spec.from_cache:
                if self.pd is not None and spec.transfer_id is not None:
                    out = self.scratch_for(spec.end)
                    self.pd.send_from_cache(
                        cache, spec.transfer_id, spec.tokens, spec.cache_salt, out
                    )
                continue
            if not self.wanted(spec):
                continue  # the skip rules (the module docstring)
            tables = self.attention_tables(spec.tables)
            states = self.states
            if self.one_copy is not None and spec.transfer_id is None:
                # Straight into kvtier's pages, no copy buffer (one_copy.py; in-process only).
                tokens = as_token_array(spec.tokens)
                keys = cache.request_keys(tokens, spec.request_id, cache_salt=spec.cache_salt)
                published = self._published(spec, keys.spans, spec.start // chunk)
                if self.events is not None and published is not None:
                    self.events.expect(*published, spec.tokens)  # the tiers publish them
                self.one_copy.save(spec, tables, tokens, keys, self.drain if self.late else None)
                continue
            # The buffer holds this save's chunks only (row 0: the chunk start of its first
            # token), so it is as large as a step's saves, never a whole prompt's KV: on a GPU
            # it is memory outside vLLM's budget. A save behind the step has its own.
            base = spec.start // chunk * chunk
            drain = self.drain if self.late and spec.transfer_id is None else None
            buffer = drain.take() if drain is not None else None
            out = buffer.rows(spec.end - base) if buffer else self.scratch_for(spec.end - base)
            if states is not None and not states.fits(out, spec.end, chunk, base):
                if drain is not None and buffer is not None:
                    drain.give_back(buffer)
                continue  # a checkpoint too short to hold the state: its chunks still hit
            paged.gather(tables, spec.start, spec.end, out, base)
            if states is not None:
                # One chunk per save (or a prompt's checkpoint), ending where the step ended.
                states.gather(spec.group_block_ids, spec.end, chunk, out, base)
            store = self.job(spec, out, base)
            if drain is not None and buffer is not None:
                drain.submit(spec.request_id, store, buffer)
            else:
                store()

    def wanted(self, spec: SaveSpec) -> bool:
        """Whether ``spec``'s chunks can be saved whole (the skip rules, but ``from_cache``
        and a state too long for its checkpoint, which :meth:`save` sees)."""
        if self.loads.is_short(spec.request_id):
            # This step computed the request on top of blocks its load could not fill:
            # vLLM throws that away and recomputes, and so must kvtier (never store KV
            # that attended to garbage). The scheduler re-offers the chunks later.
            return False
        tables = self.attention_tables(spec.tables)
        chunk = self.cache.config.chunk_size
        if not self.paged.complete(tables, spec.start, spec.end, chunk):
            return False  # a sliding-window group dropped blocks of this range: not whole
        states = self.states
        # No state kept at this chunk's end: the chunk cannot be whole.
        return states is None or states.present(spec.group_block_ids, spec.end)

    def job(self, spec: SaveSpec, out: torch.Tensor, base: int) -> Callable[[], None]:
        """The store of ``spec`` once ``out`` (row 0: token ``base``) holds its chunks; its
        keys and events are made now, on the model thread."""
        cache, chunk = self.cache, self.cache.config.chunk_size
        # One token array for the keys and the store (each would convert the list).
        tokens = as_token_array(spec.tokens)
        # The keys its lookup hashed, extended by the new chunks only.
        keys = cache.request_keys(tokens, spec.request_id, cache_salt=spec.cache_salt)
        published = self._published(spec, keys.spans, spec.start // chunk)
        if self.events is not None and published is not None and self.engine is not None:
            # In-process: each tier publishes what it then really holds (events.py).
            self.events.expect(*published, spec.tokens)
        return partial(self._store, spec, tokens, keys, out, base, published)

    def saving(self, request_id: str) -> bool:
        """Whether a save of ``request_id`` is still copying out of its blocks."""
        return self.drain.saving(request_id)

    def _store(
        self,
        spec: SaveSpec,
        tokens: np.ndarray,
        keys: RequestKeys,
        out: torch.Tensor,
        base: int,
        published: Published | None,
    ) -> None:
        """Store one save gathered into ``out`` (row 0: token ``base``), send it on (PD) and
        report it (events): on the model thread, or behind the step (:mod:`.save_drain`)."""
        chunk = self.cache.config.chunk_size
        stored = self.cache.store(
            tokens,
            out[:, :, : spec.end - base],
            skip_leading_tokens=spec.start,
            cache_salt=spec.cache_salt,
            keys=keys,
            kv_start=base,
        )
        if self.engine is not None:  # in-process: for the request's line (on its lease)
            self.engine.record_stored(spec.request_id, stored * chunk, len(spec.tokens))
        if spec.transfer_id is not None and self.pd is not None:
            first = spec.start // chunk
            self.pd.send(spec.transfer_id, keys.spans[first:], out, base, spec.cache_salt)
        if self.events is not None and published is not None and self.engine is None:
            # Through a server, whose tiers this process cannot see: as submitted.
            self.events.stored(*published, spec.tokens, list(self.media))

    def _published(
        self, spec: SaveSpec, spans: Sequence[ChunkSpan], first: int
    ) -> Published | None:
        """The save's chunks from ``first`` on that events may name, and the key of the chunk
        before them; None if none (or no events). The router matches an event by its tokens
        alone: a chunk keyed by an adapter or an image is not published, or it would be
        credited to a text-only prompt of the same tokens."""
        if self.events is None:
            return None
        salt = spec.cache_salt
        chunk = self.cache.config.chunk_size
        last = salt.plain_chunks(chunk) if isinstance(salt, ExtraKeys) else None
        published = spans[first:last]
        if not published:
            return None
        return published, spans[first - 1].key if first else None
