"""Small decoder-only models built in code: random weights, fixed seeds, no downloads.

They exist so the oracle tests, ``kvtier demo`` and ``python -m benchmarks ttft`` run anywhere,
offline, with real transformers attention (RoPE, grouped-query attention, the model's own masks).
The weights are random, so the "text" is meaningless, but the KV is exactly what a trained model of
the same shape would cache, and greedy decoding is deterministic.

Sizes (``--model-size``), chosen on a 2-core CPU box:

    tiny    2 layers, hidden   64, 4 heads / 2 KV heads   tests (milliseconds per prefill)
    small   4 layers, hidden  512, 8 heads / 2 KV heads   the demo (prefill dominates TTFT)
    medium  4 layers, hidden 1024, 16 heads / 2 KV heads  the TTFT benchmark (4096 tokens)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvtier.errors import InputError

FAMILIES = ("llama", "qwen2", "mistral")


@dataclass(frozen=True, slots=True)
class ModelSize:
    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int


SIZES: dict[str, ModelSize] = {
    "tiny": ModelSize(num_layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=512),
    "small": ModelSize(
        num_layers=4, hidden=512, heads=8, kv_heads=2, intermediate=1408, vocab=4096
    ),
    "medium": ModelSize(
        num_layers=4, hidden=1024, heads=16, kv_heads=2, intermediate=2816, vocab=8192
    ),
}


def build_config(family: str, size: str | ModelSize, *, max_positions: int = 16384) -> Any:
    """A transformers config of ``family`` with the given size (no network access)."""
    shape = SIZES.get(size) if isinstance(size, str) else size
    if shape is None:
        raise InputError(f"model size {size!r} unknown; use one of {', '.join(SIZES)}")
    common: dict[str, Any] = {
        "vocab_size": shape.vocab,
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "max_position_embeddings": max_positions,
        # Wider than the usual 0.02: random logits with clear winners keep greedy decoding
        # well away from ties, so an fp32 rounding difference cannot flip a token.
        "initializer_range": 0.08,
        "tie_word_embeddings": False,
    }
    if family == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**common)
    if family == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(**common)
    if family == "mistral":
        from transformers import MistralConfig

        # No sliding window by default: with it, tokens beyond the window are masked, which
        # the oracle covers separately (see tests/integrations).
        return MistralConfig(**common, sliding_window=None)
    raise InputError(f"model family {family!r} unknown; use one of {', '.join(FAMILIES)}")


def build_model(
    family: str = "llama",
    size: str | ModelSize = "tiny",
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    config: Any = None,
) -> Any:
    """A randomly initialized causal LM in eval mode; the same seed gives the same weights."""
    from transformers import AutoModelForCausalLM

    cfg = config if config is not None else build_config(family, size)
    # Initialization draws from torch's global generator; restore it afterwards so building a
    # model does not change what the caller's later random calls produce.
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)  # type: ignore[no-untyped-call]
    finally:
        torch.random.set_rng_state(state)
    return model.to(dtype).eval()
