"""Which saves a scheduled step carries for a request: the scheduler side's save rules.

The scheduler (:mod:`.scheduler`) tracks requests through vLLM's hooks; this decides, for a
request whose prefill has reached ``done`` tokens after this step, what is saved::

    plain model     the prompt's whole chunks up to ``done``, each once
    state model     a chunk only in the step that ends exactly on its end, and the prompt's
                    checkpoint in the step that ends there (:mod:`.checkpoints`)
    sliding model   whole chunks, plus the prompt's checkpoint at its last whole block, in the
                    first step whose prefill reaches it (:mod:`.checkpoints`)
    PD prefiller    every save also sent (its ``transfer_id``); a state model's prefiller
    of a state      first sends its hit's chunks from kvtier's copy (``from_cache``): vLLM's
    model           blocks no longer hold the states at their ends
    an ended        with ``save_decode``: the whole chunks of prompt + output not stored yet
    request         (:meth:`StepSaves.output`; the scheduler's module docstring says how vLLM
                    keeps the blocks until the copy is done)

and how far a request is looked up (a hybrid model's prompt only to its checkpoint).

A save names its tokens by the request's own prompt list and its end: the spec's ``tokens``
are the prompt up to ``end``.
"""

from __future__ import annotations

from typing import Any

from kvtier.integrations.vllm.checkpoints import (
    lookup_end,
    save_end,
    save_start,
    sliding_checkpoint,
    sliding_checkpoint_save,
)
from kvtier.integrations.vllm.metadata import KVTierMetadata, SaveSpec
from kvtier.integrations.vllm.request_state import RequestState, copy_tables
from kvtier.request_salt import ExtraKeys


class StepSaves:
    """The save rules of one vLLM instance (see the module docstring).

    ``state_chunks``: the model has a state group. ``checkpoint_unit``: a sliding-window
    model's block unit when it saves its prompts' checkpoints (0: it does not; never for a
    state model, whose checkpoints follow its states). ``pd_sender``: a PD prefiller's
    engine id, else None. ``save_decode``: store the generated tokens' whole chunks when a
    request ends (not for a state model, a prefiller, or an instance that does not save)."""

    def __init__(
        self,
        *,
        block_size: int,
        chunk_size: int,
        saves: bool,
        pd_sender: str | None,
        state_chunks: bool,
        save_decode: bool,
        checkpoint_unit: int,
    ) -> None:
        self.block_size = block_size
        self.chunk_size = chunk_size
        self.saves = saves
        self.pd_sender = pd_sender
        self.state_chunks = state_chunks
        self.checkpoint_unit = 0 if state_chunks else checkpoint_unit
        self.save_decode = save_decode and saves and not state_chunks and pd_sender is None

    def lookup_tokens(self, state: RequestState) -> list[int]:
        """The tokens looked up: a state model's prompt only up to its checkpoint (whose
        partial chunk is the only one with a state at its end); a sliding model's that saves
        checkpoints, up to its own: no hit goes past it, and a PD decoder's pull then names
        the chunks its prefiller sent."""
        if self.checkpoint_unit:
            end = sliding_checkpoint(len(state.tokens), self.checkpoint_unit, self.chunk_size)
            return state.tokens[:end] if end else state.tokens
        if not self.state_chunks:
            return state.tokens
        return state.tokens[: lookup_end(len(state.tokens), self.block_size, self.chunk_size)]

    def add(self, meta: KVTierMetadata, rid: str, state: RequestState, done: int) -> None:
        """This step's saves of ``rid``, whose prefill has reached ``done`` tokens."""
        if not self.saves or state.uncached is not None:
            return
        if self.state_chunks and self.pd_sender is not None and state.transfer_id is not None:
            self._send_from_cache(meta, rid, state)
        size = self.chunk_size
        if self.state_chunks:
            args = (done, state.saved, len(state.tokens), self.block_size, size)
            end = save_end(*args)  # only where a state is
        else:
            end = min(done, len(state.tokens)) // size * size
        if end > state.saved:
            meta.saves.append(self._spec(rid, state, save_start(state.saved, size), end))
            state.saved = end
        if self.checkpoint_unit and not state.checkpoint_saved:
            self._add_checkpoint(meta, rid, state, done)

    def output(self, request: Any, state: RequestState, tables: Any) -> SaveSpec | None:
        """The ending request's unsaved whole chunks of prompt + output (``tables``: every
        KV-cache group's blocks of its computed tokens), or None: nothing to save."""
        if not self.save_decode or not tables or state.uncached is not None:
            return None
        if isinstance(state.salt, ExtraKeys) and state.salt.items:
            return None  # content-keyed ranges (images, embeddings) cover the prompt only
        tokens = state.tokens + list(getattr(request, "output_token_ids", ()) or ())
        # Tokens whose KV is in the blocks: the last sampled token (and any in flight) has none.
        in_flight = int(getattr(request, "num_in_flight_tokens", 0))
        computed = int(request.num_computed_tokens) - in_flight
        size = self.chunk_size
        end = min(computed, len(tokens)) // size * size
        if end <= max(state.saved, len(state.tokens) // size * size):
            return None  # nothing past the prompt's own chunks
        groups = tuple(list(t) for t in tables) if len(tables) > 1 else ()
        rid = request.request_id
        return SaveSpec(
            rid, tokens[:end], list(tables[0]), state.saved, end, None, state.salt, groups
        )

    def _spec(self, rid: str, state: RequestState, start: int, end: int) -> SaveSpec:
        return SaveSpec(
            rid,
            state.tokens[:end],
            state.block_ids[:],
            start,
            end,
            state.transfer_id,
            state.salt,
            copy_tables(state),
        )

    def _add_checkpoint(
        self, meta: KVTierMetadata, rid: str, state: RequestState, done: int
    ) -> None:
        """A sliding model's prompt checkpoint, in the first step whose prefill reaches it:
        later, vLLM's sliding groups free the blocks it keeps."""
        n, unit, size = len(state.tokens), self.checkpoint_unit, self.chunk_size
        if done < sliding_checkpoint(n, unit, size):
            return
        state.checkpoint_saved = True
        hit = state.hit.tokens if state.hit is not None else 0
        end = sliding_checkpoint_save(done, hit, n, unit, size)
        if end:
            meta.saves.append(self._spec(rid, state, end // size * size, end))

    def _send_from_cache(self, meta: KVTierMetadata, rid: str, state: RequestState) -> None:
        """A state model's PD prefiller's hit, sent from kvtier's copy (the module docstring)."""
        hit = state.hit.tokens if state.hit is not None else 0
        held = min(hit, len(state.tokens) - 1) // self.block_size * self.block_size
        if held > state.saved:
            start = save_start(state.saved, self.chunk_size)
            tokens, transfer = state.tokens[:held], state.transfer_id
            meta.saves.append(
                SaveSpec(rid, tokens, [], start, held, transfer, state.salt, (), from_cache=True)
            )
            state.saved = held
