"""Where a sliding-window model's prompt leaves a checkpoint: a partial chunk at its last
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


def prompt_anchor(prompt_tokens: int, unit: int, chunk_size: int) -> int:
    """The prompt's checkpoint: its last whole block's end (``unit``: the block); 0 when that
    is a chunk end (the chunk's own record serves it) or there is none."""
    position = prompt_tokens // unit * unit
    return position if position > 0 and position % chunk_size else 0


def anchor_save(done: int, hit: int, prompt_tokens: int, unit: int, chunk_size: int) -> int:
    """Where the checkpoint's save ends in the step whose prefill ends at ``done`` (the
    first such step the caller asks about), or 0: no checkpoint, not reached yet, or held
    already (the hit reaches it)."""
    anchor = prompt_anchor(prompt_tokens, unit, chunk_size)
    return anchor if anchor and hit < anchor <= done else 0
