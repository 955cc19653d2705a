"""Where a state model's saves end and how far its lookup reaches (:mod:`state_steps`),
for every prompt length against a lone prefill scheduled as vLLM's align mode does."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvtier.integrations.vllm.state_steps import checkpoint, lookup_end, save_end, save_start


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
    point = checkpoint(prompt, block, chunk)
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
