"""Layer-wise loads and saves (``use_layerwise: true``) in a real vLLM (its CPU build calls
``wait_for_layer_load`` before and ``save_kv_layer`` after every attention layer): greedy
outputs equal vLLM alone's, a prompt sharing a prefix loads what layer-wise saves stored, and
a failure injected at one layer makes the request a miss that vLLM recomputes, with the same
outputs.

Two instances, one per mode: "layerwise" (loads layer by layer) and "layerwise-fault"
(every layer-wise load fails at layer 2 of the tiny model's 4, ``KVTIER_FAULT_LOAD_LAYER``).
The whole-chunk mode is the other modules' (test_vllm_connector.py): both are held to the
same ``reference``, vLLM with no connector.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvtier.integrations.vllm.layerwise import FAULT_ENV

from .conftest import PROMPTS
from .vllm_helpers import Instances, VllmInstance, unique_engine_id

pytestmark = pytest.mark.slow

FAULT_LAYER = 2


def start(model_dir: Path, name: str, fault: int | None = None) -> VllmInstance:
    with pytest.MonkeyPatch.context() as patch:  # vLLM's workers copy the environment
        if fault is None:
            patch.delenv(FAULT_ENV, raising=False)
        else:
            patch.setenv(FAULT_ENV, str(fault))
        return VllmInstance(
            model_dir,
            engine_id=unique_engine_id(f"kvtier-test-{name}"),
            extra={"max_local_cpu_size": "64MiB", "use_layerwise": True},
        )


def worker(stats: dict[str, Any], key: str) -> int:
    return int(stats["worker"][key])


def delta(after: dict[str, Any], before: dict[str, Any], key: str) -> int:
    return int(after[key]) - int(before[key])


@pytest.mark.timeout(900, func_only=True)  # starts a vLLM: minutes on a busy machine
def test_layer_wise_loads_give_the_same_tokens(
    reference: dict[str, list[list[int]]], model_dir: Path, instances: Instances
) -> None:
    main = instances.get("layerwise", lambda: start(model_dir, "layerwise"))
    s0 = main.stats()
    assert main.generate([PROMPTS["a"]]) == reference["a"]
    s1 = main.stats()
    assert delta(s1, s0, "hit_tokens") == 0 and delta(s1, s0, "stored_chunks") == 3

    main.llm.reset_prefix_cache()  # so kvtier's CPU tier serves, layer by layer
    assert main.generate([PROMPTS["a"]]) == reference["a"]
    s2 = main.stats()
    assert delta(s2, s1, "hit_tokens") == 768
    assert worker(s2, "layerwise_loads") - worker(s1, "layerwise_loads") == 1
    assert worker(s2, "layerwise_failures") == 0

    # Several requests in one step share the step's staging and slots; "b" shares 2 chunks
    # with "a" and loads them on top of its own.
    prompts = [PROMPTS["c"], PROMPTS["d"]]
    assert main.generate(prompts) == reference["c"] + reference["d"]
    main.llm.reset_prefix_cache()
    assert (
        main.generate([*prompts, PROMPTS["b"]])
        == reference["c"] + reference["d"] + (reference["b"])
    )
    s3 = main.stats()
    assert worker(s3, "layerwise_loads") - worker(s2, "layerwise_loads") == 3
    assert worker(s3, "layerwise_failures") == 0
    assert delta(s3, s2, "hit_tokens") == 768 + 512 + 512
    main.assert_clean()


@pytest.mark.timeout(900, func_only=True)
def test_a_shared_prefix_loads_what_layer_wise_saves_stored(
    reference: dict[str, list[list[int]]], model_dir: Path, instances: Instances
) -> None:
    """ "b" shares "a"'s first 2 chunks: with kvtier emptied first, what "b" loads is what
    "a"'s layer-wise saves (save_kv_layer, layer by layer) stored."""
    main = instances.get("layerwise", lambda: start(model_dir, "layerwise"))
    assert main.probe is not None
    main.llm.reset_prefix_cache()
    main.probe.clear()
    s0 = main.stats()
    assert main.generate([PROMPTS["a"]]) == reference["a"]
    s1 = main.stats()
    assert delta(s1, s0, "stored_chunks") == 3
    assert worker(s1, "layerwise_saves") > worker(s0, "layerwise_saves")
    assert worker(s1, "layerwise_save_skips") == 0

    main.llm.reset_prefix_cache()  # so "b"'s prefix comes from kvtier
    assert main.generate([PROMPTS["b"]]) == reference["b"]
    s2 = main.stats()
    assert delta(s2, s1, "hit_tokens") == 512
    assert worker(s2, "layerwise_loads") - worker(s1, "layerwise_loads") == 1
    main.assert_clean()


@pytest.mark.timeout(900, func_only=True)
def test_a_failure_at_one_layer_is_recomputed_with_the_same_tokens(
    model_dir: Path, instances: Instances
) -> None:
    """Held to the same instance's cold run (nothing loaded), which the test above holds,
    for this mode, to vLLM alone: one vLLM start less."""
    main = instances.get("layerwise-fault", lambda: start(model_dir, "fault", FAULT_LAYER))
    prompts = [PROMPTS["a"], PROMPTS["d"]]
    s0 = main.stats()
    cold = main.generate(prompts)
    s1 = main.stats()
    assert delta(s1, s0, "hit_tokens") == 0
    main.llm.reset_prefix_cache()
    # Both hits are loaded layer by layer until layer 2, then fail: vLLM drops the step's
    # output for them and recomputes from their first loaded token.
    assert main.generate(prompts) == cold
    s2 = main.stats()
    assert delta(s2, s1, "hit_tokens") == 768 + 512
    assert worker(s2, "layerwise_failures") - worker(s1, "layerwise_failures") == 2
    assert worker(s2, "layerwise_loads") == 0
    main.assert_clean()
