"""Checkpoints: the records of a hybrid model's prompt that end where a chunk does not.

One idea, kvtier's one name for it (the engine's side is :mod:`kvtier.engine._checkpoints`,
the lookup that probes for them): a partial chunk keyed by the prefix up to its end, stored
where a later prompt is likely to resume and a whole chunk cannot serve it. A hybrid model
has one for either of two reasons, each with its own rules below:

- a **state model** (Mamba, gated delta-net) resumes only where a state was taken;
- a **sliding-window model** whose chunks are larger than what its sliding groups keep.

The scheduler's per-step saves (:mod:`.step_saves`) ask these functions where each save ends.

State models
------------
Where a state model's states are, so which steps save and how far a lookup reaches.

A model with a state group (Mamba, gated delta-net) resumes only where a state was taken.
vLLM's ``align`` mode keeps a request's state only at the end of a prefill step, and clips
each step to a block boundary; it also ends a step at the prompt's last block boundary
before its last token, and its own prefix cache resumes a repeat there. So kvtier stores:

- a chunk, in the step whose prefill ends exactly at that chunk's end (the state there is
  in vLLM's block then, and only then: a later step moves on);
- the prompt's checkpoint: its tail from the last chunk end to that last block boundary, as a
  partial chunk with the state at its end, in the step that ends there (after every chunk
  before it). It is keyed by the prefix up to there, so a lookup of the prompt up to its
  checkpoint (:func:`lookup_end`) finds it and nothing else resumes from it::

    steps   |--256--|--256--|-128-|-60-|     max_num_batched_tokens = chunk_size, block 64
    saves       c0      c1   cp            each with its own end state; cp: 128 tokens

A step that ran past a chunk end lost that state: the request's later chunks (and its
checkpoint) are not stored, since a chunk needs every chunk before it.

Sliding-window models
---------------------
Where a sliding-window model's prompt leaves a checkpoint: a partial chunk at its last
whole block, so a chunk larger than the window still lets a later prompt resume there.

A sliding group keeps only the last ``keep`` tokens before a chunk's end
(:func:`~kvtier.layout.sliding_keep`), so the bytes a token costs fall as the chunk grows
(:meth:`.groups.ModelGroups.default_chunk` picks four times ``keep``). Hits in whole chunks
alone would then lose up to a chunk of every prompt; the tokens people resume at are mostly
a prompt's end (a repeat, or a chat's next turn, which extends the last prompt). So besides
its whole chunks a prompt stores its checkpoint: the tail from its last chunk end to its
last whole block, as a partial chunk keyed by the prefix up to there (exact, like every
key), keeping its sliding layers' last ``keep`` tokens before that end::

    prompt    |=========c0=========|=========c1=========|====cp====|--|    n tokens
    stored     c0 (whole chunk)     c1                   the tail to n // block * block

A later lookup probes the block boundaries of the chunk it misses
(:mod:`kvtier.engine._checkpoints`), so a chat's next turn resumes at the last turn's
checkpoint. The checkpoint is saved in the step whose prefill reaches it: after that vLLM's
sliding groups free the blocks behind their window, and :meth:`.paged.PagedKV.complete`
refuses a save whose kept tokens are gone (a miss, never a wrong record).

Replayed on the production trace in equal bytes (``kvtier bench sliding``), the policy
``chunk G+checkpoints`` that this is hits within 6 points of per-group records whose
sliding parts are evicted first at 2% capacity and within 1 point from 10% up, with one
fixed-size record per chunk in every tier.
"""

from __future__ import annotations


# -- state models -----------------------------------------------------------------------------
def state_checkpoint(prompt_tokens: int, block_size: int, chunk_size: int) -> int:
    """The prompt's checkpoint: its last block boundary before its last token; 0 when that
    is a chunk end (the chunk itself holds that state)."""
    position = (prompt_tokens - 1) // block_size * block_size
    return position if position > 0 and position % chunk_size else 0


def lookup_end(prompt_tokens: int, block_size: int, chunk_size: int) -> int:
    """How far a state model's prompt is looked up: to its checkpoint, or all of it."""
    return state_checkpoint(prompt_tokens, block_size, chunk_size) or prompt_tokens


def save_end(done: int, saved: int, prompt_tokens: int, block_size: int, chunk_size: int) -> int:
    """Where this step's save ends (``done``: the prompt tokens computed after it; ``saved``:
    the end of what was stored before it, a chunk end or the checkpoint); 0 when the step
    stores nothing. A checkpoint stored does not stop the chunk it falls in from being
    stored when a step ends on that chunk's end (a prompt of whole chunks)."""
    base = saved // chunk_size * chunk_size
    end = min(done, prompt_tokens) // chunk_size * chunk_size
    if done == end and end - base == chunk_size:
        return end  # one chunk, ending exactly where this step ended
    if done == state_checkpoint(prompt_tokens, block_size, chunk_size) and saved == end:
        return done
    return 0


def save_start(saved: int, chunk_size: int) -> int:
    """Where a save's tokens start: the chunk the last save ended in (after a checkpoint,
    the whole chunk it falls in is gathered again)."""
    return saved // chunk_size * chunk_size


# -- sliding-window models --------------------------------------------------------------------
def sliding_checkpoint(prompt_tokens: int, unit: int, chunk_size: int) -> int:
    """The prompt's checkpoint: its last whole block's end (``unit``: the block); 0 when that
    is a chunk end (the chunk's own record serves it) or there is none."""
    position = prompt_tokens // unit * unit
    return position if position > 0 and position % chunk_size else 0


def sliding_checkpoint_save(
    done: int, hit: int, prompt_tokens: int, unit: int, chunk_size: int
) -> int:
    """Where the checkpoint's save ends in the step whose prefill ends at ``done`` (the
    first such step the caller asks about), or 0: no checkpoint, not reached yet, or held
    already (the hit reaches it)."""
    end = sliding_checkpoint(prompt_tokens, unit, chunk_size)
    return end if end and hit < end <= done else 0
