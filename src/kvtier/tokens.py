"""A request's tokens as the one form every key is hashed from: a contiguous 1-D int32
(little-endian) array. Lists, numpy arrays and torch tensors are accepted; anything else is an
:class:`~kvtier.errors.InputError` naming ``tokens``, so no numpy or torch error leaks out."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvtier.errors import InputError


def as_token_array(tokens: object) -> np.ndarray:
    """Tokens as a contiguous 1-D int32 array, without copying when they already are one.
    Anything else is an :class:`InputError` naming ``tokens``; no numpy or torch error leaks
    (an int too large for int64, a meta or sparse tensor, an object array)."""
    try:
        array = _to_array(tokens)
    except InputError:
        raise
    except (OverflowError, ValueError, TypeError, RuntimeError, NotImplementedError) as exc:
        raise InputError(
            f"tokens must be a 1-D sequence, array or tensor of int32 token ids; "
            f"converting it failed: {type(exc).__name__}: {exc}"
        ) from None
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise InputError(
            f"tokens must be a 1-D integer array, got shape {array.shape} dtype {array.dtype}"
        )
    if array.size == 0:
        raise InputError("tokens is empty: there is nothing to look up or store")
    if array.dtype != np.int32:
        low, high = int(array.min()), int(array.max())
        info = np.iinfo(np.int32)
        if low < info.min or high > info.max:
            bad = low if low < info.min else high
            raise InputError(
                f"tokens: token ids must fit in int32 ({info.min} to {info.max}), found {bad}"
            )
        array = array.astype(np.int32)
    return np.ascontiguousarray(array.astype("<i4", copy=False))


def _to_array(tokens: object) -> np.ndarray:
    if isinstance(tokens, torch.Tensor):
        if tokens.is_nested or tokens.layout != torch.strided or tokens.is_meta:
            raise InputError(
                f"tokens must be a dense tensor with data, got layout {tokens.layout} on "
                f"{tokens.device}" + (" (nested)" if tokens.is_nested else "")
            )
        if tokens.dim() != 1 or tokens.is_floating_point() or tokens.is_complex():
            raise InputError(
                f"tokens must be a 1-D integer tensor, got shape {tuple(tokens.shape)} "
                f"dtype {tokens.dtype}"
            )
        return tokens.detach().cpu().numpy()
    if isinstance(tokens, np.ndarray):
        return tokens
    if isinstance(tokens, Sequence) and not isinstance(tokens, str | bytes):
        # The distinct element types, at C speed (a prompt has thousands of ids, one type).
        kinds = set(map(type, tokens))
        if not all(issubclass(k, int | np.integer) and k is not bool for k in kinds):
            bad = next(
                t for t in tokens if not isinstance(t, int | np.integer) or isinstance(t, bool)
            )
            raise InputError(f"tokens must be integers, found {bad!r} ({type(bad).__name__})")
        return np.asarray(tokens, dtype=np.int64)
    raise InputError(
        f"tokens must be a sequence, array or tensor of ints, got {type(tokens).__name__}"
    )
