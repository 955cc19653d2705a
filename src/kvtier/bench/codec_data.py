"""Synthetic KV with the shape of real attention KV, for codec measurements.

Random-weight models give KV without the structure trained ones have, so the codec figures
are also taken on a tensor made to look like measured KV (the distributions KIVI and
KVQuant report for Llama-family models)::

    keys    per channel c of each layer and head: mean m_c ~ N(0, 0.5), std s_c = exp(N(0, 0.5));
            3 % of channels are outliers: m_c += 8 * sign(m_c), s_c *= 3
            k[t, c] = m_c + s_c * N(0, 1), then RoPE (theta 10000) by position t
    values  v[t, c] = g_h * N(0, 1), one g_h = exp(N(0, 0.3)) per layer and head

Seeded, so every run measures the same bytes.
"""

from __future__ import annotations

import torch

from kvtier.layout import KVLayout

OUTLIER_SHARE = 0.03


def synthetic_kv(layout: KVLayout, tokens: int, seed: int = 0) -> torch.Tensor:
    """``[planes, layers, tokens, hidden]`` of the layout's dtype (planes 1: the latent is
    drawn as keys are, outliers included)."""
    gen = torch.Generator().manual_seed(seed)
    layers, heads, dim = layout.num_layers, layout.num_kv_heads, layout.head_dim
    shape = (layers, 1, heads, dim)
    std = torch.exp(torch.randn(shape, generator=gen) * 0.5)
    mean = torch.randn(shape, generator=gen) * 0.5
    outlier = torch.rand(shape, generator=gen) < OUTLIER_SHARE
    mean = torch.where(outlier, mean + 8 * torch.sign(mean), mean)
    std = torch.where(outlier, std * 3, std)
    keys = mean + std * torch.randn((layers, tokens, heads, dim), generator=gen)
    keys = _rope(keys)
    planes = [keys]
    if layout.planes == 2:
        gain = torch.exp(torch.randn((layers, 1, heads, 1), generator=gen) * 0.3)
        planes.append(gain * torch.randn((layers, tokens, heads, dim), generator=gen))
    kv = torch.stack(planes).reshape(layout.planes, layers, tokens, heads * dim)
    return kv.to(layout.dtype).contiguous()


def _rope(x: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of ``head_dim`` by position (``[layers, tokens, heads, dim]``)."""
    tokens, dim = x.shape[1], x.shape[-1]
    half = dim // 2
    inv = 1.0 / (10000 ** (torch.arange(0, half).float() * 2 / dim))
    angle = torch.arange(tokens).float().view(1, tokens, 1, 1) * inv
    cos, sin = angle.cos(), angle.sin()
    a, b = x[..., :half], x[..., half : 2 * half]
    return torch.cat([a * cos - b * sin, a * sin + b * cos, x[..., 2 * half :]], -1)


def kv_page(layout: KVLayout, tokens: int, seed: int = 0) -> torch.Tensor:
    """The synthetic KV of one chunk as the flat bytes of its page."""
    return synthetic_kv(layout, tokens, seed).reshape(-1).view(torch.uint8)


def reads_back(lossless: bool, layout: KVLayout, got: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether a page read through a codec is what was stored: the same bytes for a
    lossless codec, within 5 % relative L2 error (of the layout's dtype) for a lossy one."""
    if lossless:
        return torch.equal(got, want)
    a, b = got.view(layout.dtype).float(), want.view(layout.dtype).float()
    return bool(a.isfinite().all()) and float((a - b).norm() / b.norm()) < 0.05
