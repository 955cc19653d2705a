"""Equal prompts are not equal KV: a LoRA adapter and prompt embeddings key a request's
chunks apart, as vLLM keys its own prefix cache (images: test_images.py).

A real vLLM (CPU build, fp32, its own prefix cache off so every repeat is kvtier's load)
serves the same 640-token prompt under adapter A, then B, then A again, then no adapter;
every output must equal a vLLM without a connector, and only the repeat of A may load
(512 tokens: two whole chunks). The same through the disk tier in a fresh vLLM (a restart)
and through ``kvtier server``. Prompt embeddings: a repeat of the same rows hits; rows that
differ from chunk 1 on hit chunk 0 only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.demo.checkpoint import TinyLlama, write_lora_adapter
from tests.server.server_helpers import ServerProcess

from .vllm_helpers import MAX_TOKENS, Instances, VllmInstance, tokens, unique_engine_id

pytestmark = pytest.mark.slow

CHUNK = 256
PROMPT = tokens(640, seed=41)  # 2 whole chunks + 128 tokens
OTHER = tokens(640, seed=42)  # stored under adapter A only, before the restart
SHAPE = TinyLlama()
EXTRA_ARGS: dict[str, Any] = {
    "enable_lora": True,
    "max_lora_rank": 8,
    "max_loras": 2,
    "enable_prompt_embeds": True,
}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from vllm.lora.request import LoRARequest

    root = tmp_path_factory.mktemp("adapters")
    return {
        "A": LoRARequest("A", 1, str(write_lora_adapter(root / "A", SHAPE, seed=1))),
        "B": LoRARequest("B", 2, str(write_lora_adapter(root / "B", SHAPE, seed=2))),
        "none": None,
    }


def embeddings(seed: int, *, same_until: int = 0) -> torch.Tensor:
    """640 rows of the model's width; rows before ``same_until`` are those of seed 0."""
    rows = torch.randn(640, SHAPE.hidden, generator=torch.Generator().manual_seed(seed))
    if same_until:
        rows[:same_until] = embeddings(0)[:same_until]
    return rows


EMBEDS = {"E1": embeddings(0), "E2": embeddings(1, same_until=CHUNK)}


def run(instance: VllmInstance, prompt: list[int] | str, lora: Any) -> list[int]:
    """Greedy tokens of one request: token ids under ``lora``, or named embeddings."""
    from vllm import SamplingParams
    from vllm.inputs import EmbedsPrompt, TokensPrompt

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    request: Any = (
        EmbedsPrompt(prompt_embeds=EMBEDS[prompt])
        if isinstance(prompt, str)
        else TokensPrompt(prompt_token_ids=list(prompt))
    )
    out = instance.llm.generate([request], params, lora_request=lora, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


CASES: list[tuple[list[int] | str, str]] = [
    (PROMPT, "A"),
    (PROMPT, "B"),
    (PROMPT, "A"),
    (PROMPT, "none"),
    (OTHER, "A"),
    (OTHER, "B"),
    ("E1", "none"),
    ("E1", "none"),
    ("E2", "none"),
]


@pytest.fixture(scope="module")
def expected(
    model_dir: Path, instances: Instances, adapters: dict[str, Any]
) -> dict[tuple[int, str], list[int]]:
    """vLLM without a connector: what every request must answer."""
    plain = instances.get(
        "plain-extra", lambda: VllmInstance(model_dir, engine_id=None, **EXTRA_ARGS)
    )
    return {(id(p), name): run(plain, p, adapters[name]) for p, name in CASES}


def kvtier_instance(model_dir: Path, name: str, extra: dict[str, Any]) -> VllmInstance:
    return VllmInstance(
        model_dir,
        engine_id=unique_engine_id(f"kvtier-test-{name}"),
        extra=extra,
        enable_prefix_caching=False,  # every repeat is kvtier's load
        **EXTRA_ARGS,
    )


def loaded(instance: VllmInstance, prompt: list[int] | str, lora: Any) -> tuple[list[int], int]:
    """The request's tokens, and the tokens kvtier loaded for it."""
    before = instance.stats()["hit_tokens"]
    out = run(instance, prompt, lora)
    return out, int(instance.stats()["hit_tokens"]) - int(before)


def test_adapters_and_prompt_embeddings_key_apart_in_cpu_and_on_disk_after_a_restart(
    model_dir: Path,
    instances: Instances,
    adapters: dict[str, Any],
    expected: dict[tuple[int, str], list[int]],
    tmp_path: Path,
) -> None:
    disk = {
        "max_local_cpu_size": "64MiB",
        "local_disk": str(tmp_path),
        "max_local_disk_size": "1GiB",
    }
    first = instances.get("extra-cpu", lambda: kvtier_instance(model_dir, "extra-cpu", disk))
    # What each request may load: only a repeat of its own adapter's (or rows') chunks.
    may_load = [0, 0, 2 * CHUNK, 0, 0, 0, 0, 2 * CHUNK, CHUNK]
    for (prompt, name), want in zip(CASES, may_load, strict=True):
        out, hit = loaded(first, prompt, adapters[name])
        label = f"{'embeds ' + prompt if isinstance(prompt, str) else 'tokens'} under {name}"
        assert out == expected[(id(prompt), name)], label
        assert hit == want, label
    first.assert_clean()
    assert first.probe is not None and first.probe.flush(30.0) is True
    instances.close()

    # A fresh vLLM on the same disk directory: the keys hold across the restart.
    second = instances.get("extra-disk", lambda: kvtier_instance(model_dir, "extra-disk", disk))
    for prompt, name, want in [
        (OTHER, "B", 2 * CHUNK),  # B's own chunks of OTHER, stored before the restart
        (PROMPT, "none", 2 * CHUNK),
        (PROMPT, "A", 2 * CHUNK),
        ("E2", "none", 2 * CHUNK),
    ]:
        out, hit = loaded(second, prompt, adapters[name])
        assert out == expected[(id(prompt), name)]
        assert hit == want
    second.assert_clean()
    instances.close()


def test_adapters_key_apart_through_the_kvtier_server(
    model_dir: Path,
    instances: Instances,
    adapters: dict[str, Any],
    expected: dict[tuple[int, str], list[int]],
    kvserver: ServerProcess,
) -> None:
    served = instances.get(
        "extra-server", lambda: kvtier_instance(model_dir, "extra-server", {"server": kvserver.url})
    )
    for prompt, name, want in [
        (PROMPT, "A", 0),
        (PROMPT, "B", 0),
        (PROMPT, "A", 2 * CHUNK),
        (PROMPT, "none", 0),
        ("E1", "none", 0),
        ("E2", "none", CHUNK),
    ]:
        out, hit = loaded(served, prompt, adapters[name])
        assert out == expected[(id(prompt), name)]
        assert hit == want
    instances.close()
    assert "Traceback" not in kvserver.log(), kvserver.log()
