"""The shape of the KV a model produces, and the byte arithmetic that follows from it.

One chunk holds K and V of every layer for ``chunk_size`` tokens, contiguous::

    chunk tensor: [2, num_layers, tokens, num_kv_heads * head_dim]
                   K/V  layer     token   hidden (all KV heads)

    chunk_bytes = 2 * num_layers * chunk_size * num_kv_heads * head_dim * dtype_bytes

A partial chunk of ``t < chunk_size`` tokens uses the first
``2 * num_layers * t * hidden * dtype_bytes`` bytes of its page, laid out the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.errors import InputError

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}


def dtype_name(dtype: torch.dtype) -> str:
    for name, candidate in _DTYPES.items():
        if candidate == dtype:
            return name
    raise InputError(f"KV dtype {dtype} is not supported; use one of {', '.join(_DTYPES)}")


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        allowed = ", ".join(_DTYPES)
        raise InputError(f"KV dtype {name!r} is not supported; use one of {allowed}") from None


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Per-rank KV geometry of a model: what one token's KV looks like."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= 1 << 16:
                raise InputError(
                    f"KVLayout.{name} must be an integer from 1 to 65536, got {value!r}"
                )
        if isinstance(self.dtype, str):  # allow KVLayout(..., dtype="bfloat16")
            object.__setattr__(self, "dtype", dtype_from_name(self.dtype))
        dtype_name(self.dtype)

    @property
    def hidden(self) -> int:
        """Width of one token's K (or V) across all KV heads."""
        return self.num_kv_heads * self.head_dim

    @property
    def dtype_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def token_bytes(self) -> int:
        """Bytes of K and V of all layers for one token."""
        return 2 * self.num_layers * self.hidden * self.dtype_bytes

    def chunk_bytes(self, chunk_size: int) -> int:
        return self.token_bytes() * chunk_size

    def kv_shape(self, tokens: int) -> tuple[int, int, int, int]:
        return (2, self.num_layers, tokens, self.hidden)

    def describe(self) -> str:
        return (
            f"{self.num_layers} layers x {self.num_kv_heads} KV heads x {self.head_dim} "
            f"head dim, {dtype_name(self.dtype)}"
        )
