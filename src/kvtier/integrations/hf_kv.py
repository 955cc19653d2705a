"""Between kvtier's KV layout and a transformers ``DynamicCache``.

::

    kvtier   kv[2, num_layers, tokens, kv_heads * head_dim]    K = kv[0], V = kv[1]
    HF       layer l: keys / values [batch=1, kv_heads, tokens, head_dim]

    kv[0, l]  ─view→  [tokens, kv_heads, head_dim]  ─permute(1, 0, 2)→  [kv_heads, tokens, head_dim]

So a layer converts with one view and one strided copy: no per-token Python, and on the way in
no copy at all before the cache takes the tensors. Keys are stored after RoPE, so cached KV is
valid only at the positions it was computed at, which is exactly what a shared prefix gives.

MLA (a config with ``kv_lora_rank``, DeepSeek-V2 style): transformers caches per layer the
normed latent as "keys" ``[1, 1, tokens, kv_lora_rank]`` and the rope key as "values" ``[1, 1,
tokens, qk_rope_head_dim]``; kvtier stores them side by side as one latent of
``kv_lora_rank + qk_rope_head_dim`` per token (planes 1), as vLLM does::

    kv[0, l, t]  =  keys[0, 0, t]  |  values[0, 0, t]        (512 | 64 for DeepSeek)

Sliding-window layers (a config whose ``layer_types`` name ``sliding_attention``, Gemma-3
style): the layout has a sliding group that keeps the last ``window`` tokens of each chunk
(the connector resumes at a chunk boundary or one token before it, and a token attends to the
``window - 1`` before it). The connector's cache holds every token of every layer; the tokens
a sliding layer did not keep come back as zeros, which the model's sliding-window mask never
reads.
"""

from __future__ import annotations

from typing import Any

import torch

from kvtier.errors import InputError
from kvtier.layout import GroupKind, KVGroup, KVLayout, sliding_keep


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
    split = latent_split(config)
    if split:
        latent = split + int(config.qk_rope_head_dim)
        return KVLayout(num_layers=layers, num_kv_heads=1, head_dim=latent, dtype=dtype, planes=1)
    return KVLayout(
        num_layers=layers,
        num_kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        dtype=dtype,
        groups=_groups(config, layers),
    )


def latent_split(model_or_config: Any) -> int:
    """Where an MLA latent splits into transformers' cached "keys" and "values" (its
    ``kv_lora_rank``); 0 for a model that caches keys and values."""
    config = _text_config(model_or_config)
    return int(getattr(config, "kv_lora_rank", None) or 0)


def _groups(config: Any, layers: int) -> tuple[KVGroup, ...]:
    """A sliding group (keeping ``window`` tokens of a chunk) and a full group when the
    config's ``layer_types`` mix sliding and full attention; else () (one full group)."""
    types = list(getattr(config, "layer_types", None) or ())[:layers]
    known = {"sliding_attention", "full_attention"}
    if not set(types) <= known:
        raise InputError(
            f"layer_types {sorted(set(types) - known)} are not modelled by kvtier's "
            "transformers connector (a recurrent state, not a per-token cache); it serves "
            "full and sliding attention layers"
        )
    window = getattr(config, "sliding_window", None)
    if "sliding_attention" not in types or not window or len(types) != layers:
        return ()
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    full = tuple(i for i, t in enumerate(types) if t == "full_attention")
    window = int(window)
    groups = [KVGroup(GroupKind.SLIDING, sliding, window, keep=sliding_keep(window, 1))]
    if full:
        groups.append(KVGroup(GroupKind.FULL, full))
    return tuple(groups)


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


def cache_from_kv(
    kv: torch.Tensor, layout: KVLayout, tokens: int, *, latent_split_at: int = 0
) -> Any:
    """A fresh ``DynamicCache`` holding the first ``tokens`` tokens of ``kv``
    (``latent_split_at``: an MLA model's :func:`latent_split`).

    The layer tensors handed to the cache are strided views of ``kv``; the cache's first update
    copies them into its own storage, so ``kv`` may be reused once the cache was extended.
    """
    from transformers import DynamicCache

    cache = DynamicCache()
    for layer in range(layout.num_layers if tokens else 0):
        keys, values = layer_kv(kv[:, layer], layout, tokens, latent_split_at=latent_split_at)
        cache.update(keys, values, layer)
    return cache


def layer_kv(
    kv_layer: torch.Tensor, layout: KVLayout, tokens: int, *, latent_split_at: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's first ``tokens`` tokens as transformers caches them: strided views of
    ``kv_layer`` (``[planes, >=tokens, hidden]``, i.e. ``kv[:, layer]``), no copy."""
    if layout.planes == 1:  # MLA: keys | values of one latent row (module docstring)
        split = _split(layout, latent_split_at)
        row = kv_layer[0, :tokens].unsqueeze(0).unsqueeze(0)  # [1, 1, tokens, latent]
        return row[..., :split], row[..., split:]
    shape = (tokens, layout.num_kv_heads, layout.head_dim)
    keys = kv_layer[0, :tokens].view(shape).permute(1, 0, 2).unsqueeze(0)
    values = kv_layer[1, :tokens].view(shape).permute(1, 0, 2).unsqueeze(0)
    return keys, values


def kv_from_cache(
    cache: Any, layout: KVLayout, tokens: int, *, start: int = 0, latent_split_at: int = 0
) -> torch.Tensor:
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
    if layout.planes == 1:  # MLA: keys | values into one latent row (module docstring)
        split = _split(layout, latent_split_at)
        for index, layer in enumerate(layers):
            _check_layer(index, layer.keys, tokens)
            kv[0, index, start:tokens, :split].copy_(layer.keys[0, 0, start:tokens])
            kv[0, index, start:tokens, split:].copy_(layer.values[0, 0, start:tokens])
        return kv
    shape = (count, layout.num_kv_heads, layout.head_dim)
    for index, layer in enumerate(layers):
        keys, values = layer.keys, layer.values
        _check_layer(index, keys, tokens)
        kv[0, index, start:tokens].view(shape).copy_(keys[0, :, start:tokens].permute(1, 0, 2))
        kv[1, index, start:tokens].view(shape).copy_(values[0, :, start:tokens].permute(1, 0, 2))
    return kv


def _check_layer(index: int, keys: torch.Tensor, tokens: int) -> None:
    if keys.shape[0] != 1 or keys.shape[-2] < tokens:
        raise InputError(
            f"cache layer {index} holds keys of shape {tuple(keys.shape)}; expected batch 1 "
            f"and at least {tokens} tokens (a sliding-window layer keeps fewer)"
        )


def _split(layout: KVLayout, at: int) -> int:
    if not 0 < at < layout.head_dim:
        raise InputError(
            f"an MLA layout of latent {layout.head_dim} needs latent_split_at in "
            f"1..{layout.head_dim - 1} (the model's kv_lora_rank), got {at}"
        )
    return at
