"""Shared pieces of the cached == recomputed oracle: tiny models and the reference decoder."""

from __future__ import annotations

import functools
from typing import Any

import torch

from kvtier import Config, Engine
from kvtier.demo.tiny_models import build_config, build_model
from kvtier.integrations.hf_kv import layout_from_model

CHUNK = 16
VOCAB = 512  # the tiny size's vocabulary

# (family, dtype, logits tolerance): fp32 reuse is exact up to summation order; bf16 rounds
# each layer's output, so its logits may move by a few bf16 ulps while the argmax stays put.
CASES = [
    ("llama", torch.float32, 1e-5),
    ("qwen2", torch.float32, 1e-5),
    ("mistral", torch.float32, 1e-5),
    ("llama", torch.bfloat16, 6e-2),
    ("qwen2", torch.bfloat16, 6e-2),
    ("mistral", torch.bfloat16, 6e-2),
]
CASE_IDS = [f"{family}-{str(dtype).removeprefix('torch.')}" for family, dtype, _ in CASES]


@functools.cache
def tiny_model(family: str, dtype: torch.dtype, sliding_window: int | None = None) -> Any:
    config = build_config(family, "tiny")
    if sliding_window is not None:
        config.sliding_window = sliding_window
    return build_model(family, "tiny", dtype=dtype, seed=7, config=config)


def make_engine(model: Any, **overrides: object) -> Engine:
    values: dict[str, object] = {"chunk_size": CHUNK, "max_local_cpu_size": "8MiB"}
    values.update(overrides)
    config = Config.load(overrides=values, env={})
    return Engine(config, layout_from_model(model), model_name="oracle").open()


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def reference(
    model: Any, prompt: torch.Tensor, max_new_tokens: int
) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens from transformers' own ``generate`` (no kvtier anywhere) and the prefill
    logits of a plain full forward pass."""
    prompt = prompt.to(model.device)
    with torch.inference_mode():
        full = model(prompt.unsqueeze(0)).logits[0, -1].cpu()
        out = model.generate(
            prompt.unsqueeze(0),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=model.device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist(), full
