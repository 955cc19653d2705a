"""Realistic model shapes with random weights written in code, for ``python -m benchmarks serve``.

The tiny test Llama (4 layers, hidden 256) has 4 KiB of KV per token in fp32: every cached
variant is within a few milliseconds of vLLM's own prefix cache, which says little. These
shapes have the KV geometry and the compute of real small models, so that on 2 CPU cores a
4k-16k-token prefill costs seconds and a load moves tens of KB per token::

    name          layers  hidden  heads  kv heads  head dim  intermediate  KV / token (bf16)
    qwen2.5-0.5b  24      896     14     2         64        4864          12 KiB
    llama-3.2-1b  16      2048    32     8         64        8192          32 KiB

Llama-style blocks (no attention bias) and a 32,000-word vocabulary instead of the real
tokenizers' 128k-152k: KV, attention and MLP costs follow the shape, and the embedding and
output matrices, which the KV does not depend on, stay small enough to write quickly. Weights
are seeded (the same bytes every time), written by the tiny Llama writer.
"""

from __future__ import annotations

from pathlib import Path

from kvtier.demo.checkpoint import TinyLlama, write_tiny_llama
from kvtier.errors import InputError

SHAPES: dict[str, TinyLlama] = {
    "tiny": TinyLlama(),
    "qwen2.5-0.5b": TinyLlama(
        num_layers=24,
        hidden=896,
        heads=14,
        kv_heads=2,
        intermediate=4864,
        vocab=32000,
        max_positions=32768,
    ),
    "llama-3.2-1b": TinyLlama(
        num_layers=16,
        hidden=2048,
        heads=32,
        kv_heads=8,
        intermediate=8192,
        vocab=32000,
        max_positions=32768,
    ),
}


def kv_bytes_per_token(shape: TinyLlama, dtype_bytes: int = 2) -> int:
    """K and V of every layer for one token."""
    return 2 * shape.num_layers * shape.kv_heads * shape.head_dim * dtype_bytes


def write_shape(path: str | Path, name: str, *, seed: int = 0) -> Path:
    """Write the checkpoint of shape ``name`` (see :data:`SHAPES`) into ``path``; a directory
    that already holds it (same ``config.json``) is reused."""
    if name not in SHAPES:
        raise InputError(f"model shape {name!r} is unknown; use one of {', '.join(SHAPES)}")
    out = Path(path)
    marker = out / f".kvtier-shape-{name}-{seed}"
    if marker.exists() and (out / "model.safetensors").exists():
        return out
    write_tiny_llama(out, SHAPES[name], seed=seed)
    marker.touch()
    return out
