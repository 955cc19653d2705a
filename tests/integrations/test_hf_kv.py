"""kvtier layout <-> DynamicCache conversion, and layouts read from model configs."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from kvtier import InputError, KVLayout
from kvtier.integrations.hf_kv import cache_from_kv, kv_from_cache, layout_from_model
from kvtier.integrations.sampling import Sampling, pick_token
from tests.integrations.oracle import tiny_model

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.float32)


def test_round_trip_is_exact_and_heads_land_where_transformers_expects() -> None:
    kv = torch.randn(LAYOUT.kv_shape(10))
    cache = cache_from_kv(kv, LAYOUT, 7)
    assert cache.get_seq_length() == 7
    keys = cache.layers[1].keys
    assert keys.shape == (1, 2, 7, 4)
    # Head h of token t is columns [h*head_dim, (h+1)*head_dim) of kvtier's row t.
    assert torch.equal(keys[0, 1, 5], kv[0, 1, 5, 4:8])
    assert torch.equal(cache.layers[2].values[0, 0, 6], kv[1, 2, 6, 0:4])
    back = kv_from_cache(cache, LAYOUT, 7, start=2)
    assert torch.equal(back[:, :, 2:7], kv[:, :, 2:7])
    kv.zero_()  # the cache owns copies: the scratch buffer may be reused at once
    assert not torch.equal(cache.layers[0].keys, torch.zeros_like(cache.layers[0].keys))


def test_empty_prefix_gives_an_empty_cache() -> None:
    assert cache_from_kv(torch.empty(LAYOUT.kv_shape(0)), LAYOUT, 0).get_seq_length() == 0


def test_a_cache_shorter_than_asked_is_refused() -> None:
    cache = cache_from_kv(torch.randn(LAYOUT.kv_shape(4)), LAYOUT, 4)
    with pytest.raises(InputError, match="at least 6 tokens"):
        kv_from_cache(cache, LAYOUT, 6)


def test_layout_from_model_and_config() -> None:
    model = tiny_model("qwen2", torch.bfloat16)
    assert layout_from_model(model) == KVLayout(2, 2, 16, torch.bfloat16)
    config = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=1,
        num_hidden_layers=3,
        head_dim=32,
    )
    assert layout_from_model(config, torch.float16) == KVLayout(3, 1, 32, torch.float16)
    with pytest.raises(InputError, match="decoder-only"):
        layout_from_model(object())


def test_sampling_limits() -> None:
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert pick_token(logits, Sampling(), None) == 1
    for narrow in (Sampling(do_sample=True, top_k=1, seed=0), Sampling(do_sample=True, top_p=1e-3)):
        assert {pick_token(logits, narrow, narrow.generator()) for _ in range(20)} == {1}
    wide = Sampling(do_sample=True, top_k=2, seed=1)
    gen = wide.generator()
    assert {pick_token(logits, wide, gen) for _ in range(200)} == {1, 2}
    for bad in ({"temperature": 0.0}, {"top_k": -1}, {"top_p": 0.0}):
        with pytest.raises(InputError):
            Sampling(do_sample=True, **bad)  # type: ignore[arg-type]
