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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from kvtier.cache import KVCache
from kvtier.engine import Engine
from kvtier.integrations.vllm.events import EventLog
from kvtier.integrations.vllm.loads import Loads
from kvtier.integrations.vllm.metadata import KVTierMetadata, SaveSpec
from kvtier.integrations.vllm.paged import PagedKV
from kvtier.integrations.vllm.pd import PDEndpoint
from kvtier.integrations.vllm.save_drain import SaveDrain
from kvtier.integrations.vllm.states import PagedState
from kvtier.keys import ChunkKey, ChunkSpan, RequestKeys
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

    def save(self, meta: KVTierMetadata) -> None:
        cache, paged, chunk = self.cache, self.paged, self.cache.config.chunk_size
        for spec in meta.saves:
            if spec.from_cache:
                if self.pd is not None and spec.transfer_id is not None:
                    out = self.scratch_for(spec.end)
                    self.pd.send_from_cache(
                        cache, spec.transfer_id, spec.tokens, spec.cache_salt, out
                    )
                continue
            if self.loads.is_short(spec.request_id):
                # This step computed the request on top of blocks its load could not fill:
                # vLLM throws that away and recomputes, and so must kvtier (never store KV
                # that attended to garbage). The scheduler re-offers the chunks later.
                continue
            tables = self.attention_tables(spec.tables)
            if not paged.complete(tables, spec.start, spec.end, chunk):
                continue  # a sliding-window group dropped blocks of this range: not whole
            states = self.states
            if states is not None and not states.present(spec.group_block_ids, spec.end):
                continue  # no state kept at this chunk's end: the chunk cannot be whole
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
            # One token array for the keys and the store (each would convert the list).
            tokens = as_token_array(spec.tokens)
            # The keys its lookup hashed, extended by the new chunks only.
            keys = cache.request_keys(tokens, spec.request_id, cache_salt=spec.cache_salt)
            published = self._published(spec, keys.spans, spec.start // chunk)
            if self.events is not None and published is not None and self.engine is not None:
                # In-process: each tier publishes what it then really holds (events.py).
                self.events.expect(*published, spec.tokens)
            store = partial(self._store, spec, tokens, keys, out, base, published)
            if drain is not None and buffer is not None:
                drain.submit(spec.request_id, store, buffer)
            else:
                store()

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
