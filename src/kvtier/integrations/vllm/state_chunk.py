"""A configured ``chunk_size`` a state (Mamba/GDN) model cannot use gives way to one it can.

vLLM keeps a state model's recurrent state only where a prefill step ends (:mod:`.groups`),
so kvtier's chunks must end there: with vLLM's default step budget (4096 on its CPU build)
an LMCache config's ``chunk_size: 256`` has no state at 15 of every 16 chunk ends, and
kvtier used to switch itself off for the model with one warning. Every LMCache user of such
a model got nothing, while kvtier's own chunk (the step budget) reuses what vLLM's own
prefix cache reuses. Now the configured chunk gives way to that one, said in one line;
kvtier stays off only where no chunk can work (a budget no block size divides, states not
kept at block boundaries), with the refusal naming the setting as before.

Both connector roles choose from the same vLLM config and kvtier config, so they agree.
"""

from __future__ import annotations

from kvtier.integrations.vllm.groups import ModelGroups


def workable_chunk(
    groups: ModelGroups, chunk_size: int, block_size: int, max_num_batched_tokens: int
) -> tuple[int, str]:
    """(the chunk to use, the line saying why it is not ``chunk_size``; '' when it is)."""
    refusal = groups.state_refusal(chunk_size, max_num_batched_tokens)
    if not refusal:
        return chunk_size, ""
    chunk = groups.default_chunk(block_size, max_num_batched_tokens)
    if chunk == chunk_size or groups.state_refusal(chunk, max_num_batched_tokens):
        return chunk_size, ""  # no chunk works: the refusal stands, naming the setting
    return chunk, (
        f"kvtier: chunk_size {chunk_size} cannot keep this model's Mamba/GDN states "
        f"({refusal}); using chunk_size {chunk} (vLLM's step budget) instead, which reuses "
        "what vLLM's own prefix cache reuses. Set chunk_size to it (or leave it unset) to "
        "silence this line"
    )
