"""A hybrid model's checkpoints (:mod:`kvtier.integrations.vllm.checkpoints`): where a state
model's saves end and how far its lookup reaches, for every prompt length against a lone
prefill scheduled as vLLM's align mode does; and where a sliding-window model's prompt
checkpoint is and in which step it is saved, against every step schedule a prefill may take."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvtier.integrations.vllm.checkpoints import (
    lookup_end,
    save_end,
    save_start,
    sliding_checkpoint,
    sliding_checkpoint_save,
    state_checkpoint,
)


def align_mode_steps(prompt: int, budget: int, block: int) -> list[int]:
    """The step ends of a lone prefill in vLLM's align mode: the budget clipped to a block
    boundary, and a stop at the prompt's last block boundary before its last token."""
    last_cache = (prompt - 1) // block * block
    ends, done = [], 0
    while done < prompt:
        end = min(done + budget, prompt)
        if end < prompt:
            end = end // block * block
        if done < last_cache < end:
            end = last_cache
        ends.append(end)
        done = end
    return ends


@given(
    prompt=st.integers(2, 5000),
    block=st.sampled_from([16, 64, 128]),
    chunks_of=st.integers(1, 8),
)
def test_a_lone_prefill_saves_every_chunk_and_its_checkpoint_once(
    prompt: int, block: int, chunks_of: int
) -> None:
    chunk = block * chunks_of  # kvtier's chunk: the step budget, a multiple of the block
    saved, saves = 0, []
    for done in align_mode_steps(prompt, chunk, block):
        end = save_end(done, saved, prompt, block, chunk)
        if end > saved:
            saves.append((save_start(saved, chunk), end))
            saved = end
    whole = [(i * chunk, (i + 1) * chunk) for i in range(prompt // chunk)]
    point = state_checkpoint(prompt, block, chunk)
    expected = whole + ([(point // chunk * chunk, point)] if point else [])
    assert sorted(saves, key=lambda s: s[1]) == sorted(expected, key=lambda s: s[1])
    if point:  # a block boundary inside a chunk, before the last token
        assert point % block == 0 and point % chunk and point < prompt
        assert lookup_end(prompt, block, chunk) == point
    else:
        assert lookup_end(prompt, block, chunk) == prompt


def test_a_step_past_a_chunk_end_saves_nothing_more() -> None:
    # chunk 256, block 64, a 700-token prompt whose first step ran to 300: chunk 0's state
    # is gone, so neither chunk 1 nor the checkpoint (640) is saved.
    assert save_end(300, 0, 700, 64, 256) == 0
    assert save_end(512, 0, 700, 64, 256) == 0
    assert save_end(640, 0, 700, 64, 256) == 0
    assert save_end(640, 512, 700, 64, 256) == 640


# -- sliding-window models ---------------------------------------------------------------
BLOCKS = st.sampled_from([16, 32, 128])


@given(st.integers(0, 20_000), BLOCKS, st.integers(1, 40))
def test_the_checkpoint_is_the_prompts_last_whole_block_unless_a_chunk_ends_there(
    prompt: int, block: int, blocks_per_chunk: int
) -> None:
    chunk = block * blocks_per_chunk
    checkpoint = sliding_checkpoint(prompt, block, chunk)
    last = prompt // block * block
    if last == 0 or last % chunk == 0:
        assert checkpoint == 0  # the chunk's own record (or nothing) ends there
    else:
        assert checkpoint == last and checkpoint % block == 0 and checkpoint % chunk
        assert prompt - block < checkpoint <= prompt


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
    checkpoint = sliding_checkpoint(prompt, block, chunk)
    done, saves = hit, []
    for budget in budgets:
        done = min(prompt, done + budget)
        if done < checkpoint:
            assert sliding_checkpoint_save(done, hit, prompt, block, chunk) == 0  # not reached yet
            continue
        end = sliding_checkpoint_save(done, hit, prompt, block, chunk)
        if end:
            saves.append(end)
        break
    reached = done >= checkpoint
    wanted = checkpoint > hit and reached and checkpoint > 0
    assert saves == ([checkpoint] if wanted else [])
