"""The transformers connector's oracle for the model families of
:mod:`benchmarks.harness.families` whose caches transformers exposes: Qwen3 (full attention),
Gemma-3 (sliding-window layers: a sliding group that keeps the last ``window`` tokens of a
chunk) and DeepSeek-V2 (MLA: transformers caches the normed latent and the rope key, kvtier
stores them as one 576-wide latent). With kvtier, later prompts sharing a long prefix hit, and
the greedy tokens equal those of the same model without kvtier (fp32), with whole-chunk and
with layer-wise loads."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from benchmarks.harness.families import VOCAB, write_family

from kvtier import Config, Engine
from kvtier.integrations.hf_kv import layout_from_model
from kvtier.integrations.transformers import HFConnector

CHUNK = 256
NEW = 8


def prompt(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=gen).tolist()


P1 = prompt(700, 61)  # 2 whole chunks + 188
P2 = P1[:512] + prompt(150, 62)  # resumes at the chunk boundary 512
P3 = P1[:512]  # whole chunks: resumes one token early (511)


@pytest.fixture(scope="module", params=["qwen3", "gemma3", "deepseek-v2"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoModelForCausalLM

    path = write_family(request.param, tmp_path_factory.mktemp(request.param))
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture
def engine(model: Any) -> Iterator[Engine]:
    layout = layout_from_model(model)
    cfg = Config.load(
        overrides={"chunk_size": CHUNK, "max_local_cpu_size": f"{16 * layout.chunk_bytes(CHUNK)}B"},
        env={},
    )
    with Engine(cfg, layout, model_name="families") as cache:
        yield cache
        assert cache.check_invariants() == []


def test_family_hits_give_the_tokens_of_the_model_alone(model: Any, engine: Engine) -> None:
    plain = HFConnector(None, model)
    cached = HFConnector(engine, model)
    first = cached.generate(P1, NEW)
    assert first.reused_tokens == 0 and first.stored_chunks == 2
    assert first.tokens == plain.generate(P1, NEW).tokens
    for again, reused in ((P2, 512), (P3, 511)):
        got = cached.generate(again, NEW)
        assert got.reused_tokens == reused
        assert got.tokens == plain.generate(again, NEW).tokens


def test_family_layerwise_loads_give_the_tokens_of_the_model_alone(
    model: Any, engine: Engine
) -> None:
    """Layer by layer through device-like slots (copies that land late): the sliding group's
    kept tokens and MLA's split latent reach each layer as a whole-chunk load gives them."""
    from tests.memory.late_copies import LateCopies

    plain = HFConnector(None, model)
    cached = HFConnector(engine, model, layerwise=True, copies=LateCopies(everything=True))
    cached.generate(P1, NEW)
    for again, reused in ((P2, 512), (P3, 511)):
        got = cached.generate(again, NEW)
        assert got.reused_tokens == reused
        assert got.tokens == plain.generate(again, NEW).tokens
    assert cached.layerwise is not None
    assert cached.layerwise.loads == 2 and cached.layerwise.failures == 0


def test_each_family_stores_what_its_cache_holds(model: Any) -> None:
    layout = layout_from_model(model)
    kind = model.config.model_type
    per_layer_kv = 2 * 2 * 64 * 4  # K and V x 2 KV heads x 64 x fp32
    if kind == "gemma3_text":
        assert layout.describe_groups() == "sliding/w128/k128:0,2;full:1,3"
        assert layout.chunk_bytes(CHUNK) == per_layer_kv * (2 * 128 + 2 * 256)
    elif kind == "deepseek_v2":
        assert layout.planes == 1 and layout.head_dim == 512 + 64
        assert layout.chunk_bytes(CHUNK) == 4 * 576 * 4 * CHUNK
    else:
        assert layout.chunk_bytes(CHUNK) == 4 * per_layer_kv * CHUNK


def test_a_layer_kind_with_a_recurrent_state_is_refused_clearly() -> None:
    from benchmarks.harness.families import family

    from kvtier.errors import InputError

    with pytest.raises(InputError, match="linear_attention"):
        layout_from_model(family("qwen3-next").config(), torch.bfloat16)
