"""Where a state model's states are, so which steps save and how far a lookup reaches.

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
"""

from __future__ import annotations


def checkpoint(prompt_tokens: int, block_size: int, chunk_size: int) -> int:
    """The prompt's checkpoint: its last block boundary before its last token; 0 when that
    is a chunk end (the chunk itself holds that state)."""
    position = (prompt_tokens - 1) // block_size * block_size
    return position if position > 0 and position % chunk_size else 0


def lookup_end(prompt_tokens: int, block_size: int, chunk_size: int) -> int:
    """How far a state model's prompt is looked up: to its checkpoint, or all of it."""
    return checkpoint(prompt_tokens, block_size, chunk_size) or prompt_tokens


def save_end(done: int, saved: int, prompt_tokens: int, block_size: int, chunk_size: int) -> int:
    """Where this step's save ends (``done``: the prompt tokens computed after it; ``saved``:
    the end of what was stored before it, a chunk end or the checkpoint); 0 when the step
    stores nothing. A checkpoint stored does not stop the chunk it falls in from being
    stored when a step ends on that chunk's end (a prompt of whole chunks)."""
    base = saved // chunk_size * chunk_size
    end = min(done, prompt_tokens) // chunk_size * chunk_size
    if done == end and end - base == chunk_size:
        return end  # one chunk, ending exactly where this step ended
    if done == checkpoint(prompt_tokens, block_size, chunk_size) and saved == end:
        return done
    return 0


def save_start(saved: int, chunk_size: int) -> int:
    """Where a save's tokens start: the chunk the last save ended in (after a checkpoint,
    the whole chunk it falls in is gathered again)."""
    return saved // chunk_size * chunk_size
