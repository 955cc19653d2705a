"""A sliding-window model's prompt checkpoint (:mod:`kvtier.integrations.vllm.anchors`): where
it is, and in which step it is saved, against every step schedule a prefill may take."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvtier.integrations.vllm.anchors import anchor_save, prompt_anchor

BLOCKS = st.sampled_from([16, 32, 128])


@given(st.integers(0, 20_000), BLOCKS, st.integers(1, 40))
def test_the_checkpoint_is_the_prompts_last_whole_block_unless_a_chunk_ends_there(
    prompt: int, block: int, blocks_per_chunk: int
) -> None:
    chunk = block * blocks_per_chunk
    anchor = prompt_anchor(prompt, block, chunk)
    last = prompt // block * block
    if last == 0 or last % chunk == 0:
        assert anchor == 0  # the chunk's own record (or nothing) ends there
    else:
        assert anchor == last and anchor % block == 0 and anchor % chunk
        assert prompt - block < anchor <= prompt


@given(
    st.integers(1, 20_000),
    BLOCKS,
    st.integers(1, 40),
    st.lists(st.integers(1, 5000), min_size=1, max_size=40),
    st.integers(0, 20_000),
)
def test_exactly_one_step_saves_the_checkpoint_and_only_if_the_hit_falls_short_of_it(
    prompt: int, block: int, blocks_per_chunk: int, budgets: list[int], hit_at: int
) -> None:
    """The scheduler asks in the steps until the first whose prefill reaches the checkpoint
    (then it stops asking: vLLM frees the sliding blocks behind the window after it). The
    save is made there, once, from the chunk the checkpoint falls in, and never for a
    checkpoint the request's hit already reaches."""
    chunk = block * blocks_per_chunk
    hit = min(hit_at, prompt - 1) // block * block  # hits are whole blocks, never all
    anchor = prompt_anchor(prompt, block, chunk)
    done, saves = hit, []
    for budget in budgets:
        done = min(prompt, done + budget)
        if done < anchor:
            assert anchor_save(done, hit, prompt, block, chunk) == 0  # not reached yet
            continue
        end = anchor_save(done, hit, prompt, block, chunk)
        if end:
            saves.append(end)
        break
    reached = done >= anchor
    wanted = anchor > hit and reached and anchor > 0
    assert saves == ([anchor] if wanted else [])
