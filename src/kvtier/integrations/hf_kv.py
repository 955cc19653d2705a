"""Between kvtier's KV layout and a transformers ``DynamicCache``.

::

    kvtier   kv[2, num_layers, tokens, kv_heads * head_dim]    K = kv[0], V = kv[1]
    HF       layer l: keys / values [batch=1, kv_heads, tokens, head_dim]

    kv[0, l]  ─view→  [tokens, kv_heads, head_dim]  ─permute(1, 0, 2)→  [kv_heads, tokens, head_dim]

So a layer converts with one view and one strided copy: no per-token Python, and on the way in
no copy at all before the cache takes the tensors. Keys are stored after RoPE, so cached KV is
valid only at the positions it was computed at, which is exactly what a shared prefix gives.
"""

from __future__ import annotations

from typing import Any

import torch

from kvtier.errors import InputError
from kvtier.layout import KVLayout


def _text_config(model_or_config: Any) -> Any:
    config = getattr(model_or_config, "config", model_or_config)
    get_text = getattr(config, "get_text_config", None)
    return get_text(decoder=True) if callable(get_text) else config


def layout_from_model(model_or_config: Any, dtype: torch.dtype | None = None) -> KVLayout:
    """The per-token KV geometry of a decoder-only transformers model (or its config).

    ``dtype`` defaults to the model's parameter dtype (or the config's ``dtype``): the KV a
    model caches has the dtype it computes in.
    """
    config = _text_config(model_or_config)
    try:
        layers = int(config.num_hidden_layers)
        heads = int(config.num_attention_heads)
    except AttributeError as exc:
        raise InputError(f"not a decoder-only transformers config: {exc}") from exc
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
    if dtype is None:
        dtype = _model_dtype(model_or_config, config)
    return KVLayout(
        num_layers=layers, num_kv_heads=int(kv_heads), head_dim=int(head_dim), dtype=dtype
    )


def _model_dtype(model_or_config: Any, config: Any) -> torch.dtype:
    parameters = getattr(model_or_config, "parameters", None)
    if callable(parameters):
        for param in parameters():
            if param.is_floating_point():
                dtype: torch.dtype = param.dtype
                return dtype
    configured = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(configured, torch.dtype):
        return configured
    return torch.float32


def cache_from_kv(kv: torch.Tensor, layout: KVLayout, tokens: int) -> Any:
    """A fresh ``DynamicCache`` holding the first ``tokens`` tokens of ``kv``.

    The layer tensors handed to the cache are strided views of ``kv``; the cache's first update
    copies them into its own storage, so ``kv`` may be reused once the cache was extended.
    """
    from transformers import DynamicCache

    cache = DynamicCache()
    if tokens == 0:
        return cache
    shape = (tokens, layout.num_kv_heads, layout.head_dim)
    for layer in range(layout.num_layers):
        keys = kv[0, layer, :tokens].view(shape).permute(1, 0, 2).unsqueeze(0)
        values = kv[1, layer, :tokens].view(shape).permute(1, 0, 2).unsqueeze(0)
        cache.update(keys, values, layer)
    return cache


def kv_from_cache(cache: Any, layout: KVLayout, tokens: int, *, start: int = 0) -> torch.Tensor:
    """KV of positions ``[start, tokens)`` of ``cache`` in kvtier's layout.

    Returns a ``[2, layers, tokens, hidden]`` tensor in which only ``[start, tokens)`` is
    written: the caller stores it with ``skip_leading_tokens=start``, so the rest is never read.
    """
    layers = cache.layers
    if len(layers) != layout.num_layers:
        raise InputError(f"cache has {len(layers)} layers, the layout {layout.num_layers}")
    device = layers[0].keys.device
    kv = torch.empty(layout.kv_shape(tokens), dtype=layout.dtype, device=device)
    count = tokens - start
    shape = (count, layout.num_kv_heads, layout.head_dim)
    for index, layer in enumerate(layers):
        keys, values = layer.keys, layer.values
        if keys.shape[0] != 1 or keys.shape[-2] < tokens:
            raise InputError(
                f"cache layer {index} holds keys of shape {tuple(keys.shape)}; expected batch 1 "
                f"and at least {tokens} tokens (a sliding-window layer keeps fewer)"
            )
        kv[0, index, start:tokens].view(shape).copy_(keys[0, :, start:tokens].permute(1, 0, 2))
        kv[1, index, start:tokens].view(shape).copy_(values[0, :, start:tokens].permute(1, 0, 2))
    return kv
