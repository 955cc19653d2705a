"""Checks of what callers pass to a cache: each failure is an InputError or ConfigError
that names the value and what would be valid. The one set of checks of every surface
(:class:`kvtier.cache.KVCache`: the engine and the server client alike), so a call one
accepts is never refused by the other."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import torch

from kvtier.errors import ConfigError, InputError
from kvtier.host_memory import machine_memory
from kvtier.keys import RequestKeys
from kvtier.layout import KVLayout
from kvtier.request_salt import RequestSalt, check_salt
from kvtier.tokens import as_token_array


@dataclass(frozen=True, slots=True)
class Prompt:
    """A call's tokens, checked: a contiguous int32 array, the leading tokens the caller
    holds already (``skip_leading_tokens``) and the request's salt. ``base``: the token a
    store's ``kv`` or a retrieve's ``out`` holds in its row 0 (``kv_start``, ``out_start``)."""

    tokens: np.ndarray
    skip: int = 0
    salt: RequestSalt | None = None
    checkpoints: int = 0  # a lookup's checkpoint_tokens (kvtier.engine._checkpoints)
    base: int = 0


def check_buffer_start(name: str, value: object, prompt: Prompt, chunk_size: int) -> Prompt:
    """``name`` (``kv_start`` or ``out_start``): the token a buffer's row 0 holds, so a
    caller that stores or loads the chunks after ``skip_leading_tokens`` needs a buffer of
    only those tokens. It must be a chunk start at or before the skip (0: the buffer covers
    the prompt from its start)."""
    # The type first, with its own words: the range below refuses 16.0 or True only by
    # chance (16.0 is a chunk start, True is 1), and lets them through where it allows them.
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(
            f"{name} is {value!r} ({type(value).__name__}); it must be an int (not a bool), "
            f"a multiple of chunk_size ({chunk_size}) from 0 to skip_leading_tokens "
            f"({prompt.skip})"
        )
    if value < 0 or value % chunk_size or value > prompt.skip:
        raise InputError(
            f"{name} is {value!r}; it must be a multiple of chunk_size ({chunk_size}) from 0 "
            f"to skip_leading_tokens ({prompt.skip}): the token the buffer's first row holds"
        )
    return replace(prompt, base=value)


def check_prompt(
    tokens: object, skip_leading_tokens: object, cache_salt: object, checkpoints: object = 0
) -> Prompt:
    check_skip(skip_leading_tokens)
    salt = check_salt(cache_salt)
    assert isinstance(skip_leading_tokens, int)
    if isinstance(checkpoints, bool) or not isinstance(checkpoints, int) or checkpoints < 0:
        raise InputError(
            f"checkpoint_tokens must be an int >= 0 (0: no checkpoints), got {checkpoints!r}"
        )
    return Prompt(as_token_array(tokens), skip_leading_tokens, salt, checkpoints)


def check_keys(keys: object, chain: object, prompt: Prompt) -> None:
    """``keys`` passed to a store must be this cache's ``request_keys()`` of the same tokens
    and salt (nothing is hashed then)."""
    if (
        not isinstance(keys, RequestKeys)
        or keys.chain is not chain
        or keys.salt != prompt.salt
        or not np.array_equal(keys.tokens, prompt.tokens)
    ):
        raise InputError(
            "keys must be this engine's request_keys() of the same tokens and cache_salt"
        )


def check_kv(kv: object, layout: KVLayout, num_tokens: int) -> None:
    """``kv`` must be ``[2, num_layers, num_tokens, kv_heads*head_dim]`` of the layout's dtype."""
    expected = layout.kv_shape(num_tokens)
    if not isinstance(kv, torch.Tensor):
        raise InputError(f"kv must be a torch.Tensor, got {type(kv).__name__}")
    check_dense("kv", kv)
    if kv.dtype != layout.dtype:
        raise InputError(f"kv dtype is {kv.dtype}, but the layout says {layout.dtype}")
    if kv.dim() != 4 or tuple(kv.shape[:2]) != expected[:2] or kv.shape[3] != expected[3]:
        raise InputError(
            f"kv shape is {tuple(kv.shape)}; expected [{layout.planes}, "
            f"num_layers={layout.num_layers}, tokens, kv_heads*head_dim={layout.hidden}]"
        )
    if kv.shape[2] != num_tokens:
        raise InputError(f"kv holds {kv.shape[2]} tokens but {num_tokens} tokens were given")


def check_out(out: object, layout: KVLayout, min_tokens: int) -> None:
    """``out``, the buffer a retrieve writes into, must be a dense tensor of the layout's
    dtype shaped ``[planes, num_layers, >=min_tokens, kv_heads*head_dim]`` (any device).
    ``planes`` is the layout's own: 2 for K and V, 1 for an MLA latent. The one check of
    every surface that takes such a buffer (the engine, the server client), so a layout one
    accepts is never refused by another."""
    planes, layers, _, hidden = layout.kv_shape(0)
    if isinstance(out, torch.Tensor):
        check_dense("out", out)
    if (
        not isinstance(out, torch.Tensor)
        or out.dtype != layout.dtype
        or out.dim() != 4
        or tuple(out.shape[:2]) != (planes, layers)
        or out.shape[3] != hidden
        or out.shape[2] < min_tokens
    ):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise InputError(
            f"out must be a {layout.dtype} tensor of shape "
            f"[{planes}, {layers}, >={min_tokens}, {hidden}], got {shape}"
        )


def check_dense(name: str, tensor: torch.Tensor) -> None:
    """A tensor kvtier copies to or from must hold data in the ordinary strided layout: a
    meta tensor has no data, a sparse or nested one no byte view (torch would raise
    NotImplementedError deep inside a copy)."""
    if tensor.is_nested or tensor.layout != torch.strided or tensor.is_meta:
        kind = "nested" if tensor.is_nested else f"layout {tensor.layout}"
        raise InputError(
            f"{name} must be a dense (strided) tensor with data, got {kind} on {tensor.device}"
        )


def check_request_id(request_id: object) -> None:
    if not isinstance(request_id, str) or not request_id:
        raise InputError(f"request_id must be a non-empty string, got {request_id!r}")


def check_skip(skip_leading_tokens: object) -> None:
    if (
        isinstance(skip_leading_tokens, bool)
        or not isinstance(skip_leading_tokens, int)
        or skip_leading_tokens < 0
    ):
        raise InputError(f"skip_leading_tokens must be an int >= 0, got {skip_leading_tokens!r}")


def check_fits_in_memory(key: str, nbytes: int) -> None:
    """A buffer larger than the machine's memory (or its container's limit) is a typo,
    refused before allocating."""
    total = machine_memory()
    if total is None:
        return
    if nbytes > total:
        raise ConfigError(key, nbytes, f"at most this machine's memory ({total} bytes)")


def check_ttft(seconds: object, prompt_tokens: object, hit_tokens: object) -> None:
    """InputError naming the first bad argument of ``record_ttft``."""
    real = isinstance(seconds, int | float) and not isinstance(seconds, bool)
    if not real or not math.isfinite(seconds) or seconds < 0:  # type: ignore[arg-type,operator]
        raise InputError(f"record_ttft: seconds must be a finite number >= 0, got {seconds!r}")
    for name, value in (("prompt_tokens", prompt_tokens), ("hit_tokens", hit_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**62:
            raise InputError(f"record_ttft: {name} must be an int from 0 to 2**62, got {value!r}")
    assert isinstance(prompt_tokens, int) and isinstance(hit_tokens, int)
    if hit_tokens > prompt_tokens:
        raise InputError(
            f"record_ttft: hit_tokens ({hit_tokens}) must be <= prompt_tokens ({prompt_tokens})"
        )
