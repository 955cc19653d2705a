"""An LMCache config's chunk_size on a state model: a chunk that works instead of kvtier off
(issue 50, item 11)."""

from __future__ import annotations

from kvtier.integrations.vllm.groups import ModelGroups, VllmGroup
from kvtier.integrations.vllm.state_chunk import workable_chunk
from kvtier.layout import GroupKind


def full(block: int) -> VllmGroup:
    return VllmGroup(GroupKind.FULL, 0, ("l0",), "FullAttentionSpec", block)


def state(block: int, align: bool = True) -> VllmGroup:
    return VllmGroup(GroupKind.STATE, 0, ("s0",), "MambaSpec(GDN_ATTN)", block, 64, "GDN", align)


def test_lmcaches_256_on_a_state_model_becomes_the_step_budget_in_one_line() -> None:
    groups = ModelGroups((state(64), full(64)))
    assert groups.state_refusal(256, 4096)  # kvtier was off with it
    chunk, line = workable_chunk(groups, 256, 64, 4096)
    assert chunk == 4096 and groups.state_refusal(chunk, 4096) == ""
    assert "chunk_size 256" in line and "using chunk_size 4096" in line
    assert "\n" not in line


def test_a_chunk_that_works_is_kept_and_a_model_without_states_is_untouched() -> None:
    groups = ModelGroups((state(64), full(64)))
    assert workable_chunk(groups, 8192, 64, 4096) == (8192, "")  # a multiple of the budget
    assert workable_chunk(ModelGroups((full(16),)), 256, 16, 4096) == (256, "")


def test_where_no_chunk_works_the_refusal_stands() -> None:
    odd_budget = ModelGroups((state(64), full(64)))
    assert workable_chunk(odd_budget, 256, 64, 1000) == (256, "")
    assert odd_budget.state_refusal(256, 1000)  # and kvtier says why it is off
    not_aligned = ModelGroups((state(64, align=False), full(64)))
    assert workable_chunk(not_aligned, 256, 64, 4096) == (256, "")
