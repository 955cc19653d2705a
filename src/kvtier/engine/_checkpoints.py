"""A lookup that may end at a checkpoint: a partial chunk ending inside the prompt.

A state model (Mamba, gated delta-net) resumes only where a state was taken. Besides every
chunk end, its cache holds partial chunks that end at a checkpoint, a multiple of
``checkpoint_tokens`` (vLLM's block: a prompt's last block boundary, where vLLM keeps the
state), each keyed by the prefix up to its own end, so each is exact. A later prompt that
extends an earlier one (a chat's next turn) misses the chunk the earlier prompt ended in;
the earlier prompt's checkpoint in that chunk is its longest cached prefix::

    stored     |====c0====|==cp==|                 an earlier prompt: c0 and its checkpoint
    this       |====c0====|==========c1==========|====...   c1 is missed
    probed                 ^  ^  ^  ^  ^  ^  ^        the checkpoints inside c1, longest first
    hit        |====c0====|==cp==|

The probe hashes one partial chunk per checkpoint (the tokens of one chunk at most), asks
each tier once which of those keys it holds (no pins), then pins the longest held one as
the lookup's last chunk; nothing is pinned for the others. The lease's keys become those of
the prompt up to the checkpoint, so the load and the request's stores follow from them.
"""

from __future__ import annotations

from kvtier.errors import InputError
from kvtier.keys import ChunkSpans, KeyChain, RequestKeys
from kvtier.lease import Lease
from kvtier.storage.lookup import LookupPlan
from kvtier.storage.manager import StorageManager


def check_checkpoints(unit: int, chunk_size: int) -> None:
    if chunk_size % unit:
        raise InputError(
            f"checkpoint_tokens {unit} does not divide chunk_size {chunk_size}: use a divisor "
            "of it (vLLM's block size for a state model)"
        )


def checkpoint_ends(hit: int, num_tokens: int, chunk_size: int, unit: int) -> list[int]:
    """Checkpoints inside the chunk after a hit of ``hit`` tokens (a chunk end), before the
    prompt's end (its own partial chunk was looked up already), longest first."""
    if hit % chunk_size or hit >= num_tokens:
        return []
    last = min(hit + chunk_size, num_tokens) - 1  # the prompt's own end is not one of them
    return list(range(last // unit * unit, hit, -unit))


def extend_to_checkpoint(
    manager: StorageManager,
    chain: KeyChain,
    keys: RequestKeys,
    plan: LookupPlan,
    lease: Lease[LookupPlan],
    unit: int,
) -> tuple[RequestKeys, LookupPlan]:
    """The keys and plan of the lookup extended to the longest cached checkpoint after its
    hit, or the ones given when none is held (the module docstring)."""
    hit, size = plan.hit_tokens, chain.chunk_size
    index = hit // size
    if lease.limit is not None and index >= lease.limit:
        return keys, plan  # a load came up short there: never offered again
    ends = checkpoint_ends(hit, len(keys.tokens), size, unit)
    if not ends:
        return keys, plan
    known = keys.spans.keys[:index]
    candidates = chain.partial_keys(keys.tokens, index, ends, salt=keys.salt, known=known)
    held = manager.held(candidates)
    best = next((i for i, present in enumerate(held) if present), None)
    if best is None:
        return keys, plan
    end = ends[best]
    tail = manager.locate(ChunkSpans([candidates[best]], size, end, index), lease, 0)
    if not tail.hit_tokens:
        return keys, plan  # gone since the probe: the hit stays where it was
    extended = RequestKeys(chain, keys.tokens[:end], keys.salt, True, known)
    return extended, plan.extended(extended.spans, tail)
