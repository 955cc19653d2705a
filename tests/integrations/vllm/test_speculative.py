"""Speculative decoding: drafts from token history (ngram) are served, drafts that keep KV
kvtier does not store turn kvtier off with vLLM still serving."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from kvtier.errors import KVTierError
from kvtier.integrations.vllm.rpc import socket_path
from kvtier.integrations.vllm.speculative import speculative_refusal

from .conftest import PROMPTS
from .vllm_helpers import Instances, VllmInstance, unique_engine_id


@pytest.mark.parametrize("method", ["ngram", "ngram_gpu", "suffix"])
def test_drafts_from_token_history_are_served(method: str) -> None:
    assert speculative_refusal(SimpleNamespace(method=method)) == ""


def test_no_speculation_is_served() -> None:
    assert speculative_refusal(None) == ""


@pytest.mark.parametrize(
    "method", ["eagle", "eagle3", "mtp", "draft_model", "medusa", "custom_class", "new_one"]
)
def test_drafts_with_their_own_kv_or_unknown_turn_kvtier_off_naming_the_method(
    method: str,
) -> None:
    why = speculative_refusal(SimpleNamespace(method=method))
    assert f"method {method!r}" in why and "ngram" in why


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
A, B = PROMPTS["a"], PROMPTS["b"]  # B shares A's first 2 chunks; B is 3 chunks + 44


@pytest.fixture(scope="module")
def cold() -> dict[str, list[int]]:
    """Greedy tokens of A and B computed cold by the ngram instance (filled by the first
    test that runs it)."""
    return {}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ngram_speculation_hits_through_kvtier_with_its_cold_tokens(
    model_dir: Path, instances: Instances, cold: dict[str, list[int]]
) -> None:
    """vLLM's CPU build runs ngram speculative decoding, and kvtier serves it: B then A
    cold, then (vLLM's prefix cache reset) B again from kvtier's 3 chunks and A sharing 2 of
    them: the greedy tokens of their cold runs."""
    kv = instances.get(
        "kvtier-ngram",
        lambda: VllmInstance(
            model_dir,
            engine_id=unique_engine_id("kvtier-ngram"),
            extra={"max_local_cpu_size": "64MiB"},
            speculative_config=NGRAM,
        ),
    )
    (cold["b"],) = kv.generate([B])
    s0 = kv.stats()
    kv.llm.reset_prefix_cache()
    assert kv.generate([B]) == [cold["b"]]
    s1 = kv.stats()
    assert s1["hit_tokens"] - s0["hit_tokens"] == 768
    (cold["a"],) = kv.generate([A])  # its first 2 chunks from vLLM's own cache
    kv.llm.reset_prefix_cache()
    assert kv.generate([A]) == [cold["a"]]  # its own 3 chunks now, from kvtier
    assert kv.stats()["hit_tokens"] - s1["hit_tokens"] == 768
    kv.assert_clean()
    instances.close()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_draft_model_turns_kvtier_off_and_vllm_still_serves(
    model_dir: Path, instances: Instances, cold: dict[str, list[int]]
) -> None:
    """A draft model keeps its own KV, which kvtier does not store: vLLM starts and serves
    with kvtier off (its worker opens no lookup channel), the greedy tokens of the target."""
    engine_id = unique_engine_id("kvtier-draft")
    kv = instances.get(
        "kvtier-draft",
        lambda: VllmInstance(
            model_dir,
            engine_id=engine_id,
            extra={"max_local_cpu_size": "64MiB"},
            speculative_config={
                "method": "draft_model",
                "model": str(model_dir),
                "num_speculative_tokens": 2,
            },
        ),
    )
    outs = kv.generate([A, B])
    if cold:  # the ngram test ran first in this module
        assert outs == [cold["a"], cold["b"]]
    assert not socket_path(engine_id, 0).exists()
    with pytest.raises(KVTierError):
        kv.stats()
    kv.probe = None
    instances.close()
