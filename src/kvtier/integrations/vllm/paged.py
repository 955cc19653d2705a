"""vLLM's paged KV cache <-> kvtier chunk pages: gather and scatter by token position.

vLLM hands the worker one tensor per attention layer (``register_kv_caches``). Two layouts
are recognised from the tensors' shapes, never assumed::

    blocks-first  [num_blocks, kv_heads, block_tokens, 2*head_dim]   K | V side by side in
                  (vLLM's standardized [B, H, N, C] view; the CPU     the last dimension
                  attention backend's native layout)
    kv-first      [2, num_blocks, block_tokens, kv_heads, head_dim]  K and V planes
                  (CUDA flash-attention's classic layout)

kvtier's chunk page is ``[2, layers, tokens, kv_heads*head_dim]``. A token at position ``p``
of a request lives in the request's block ``block_ids[p // block_size]`` at offset
``p % block_size``; its slot is ``block_id * block_size + offset``. The tensor's own block
(``block_tokens``) may be smaller than vLLM's scheduler block when the kernel splits it, so
the slot is re-divided by the tensor's block length::

    position p ──▶ slot = block_ids[p // bs] * bs + p % bs ──▶ (slot // N, slot % N) in the tensor

Both directions copy each layer once with one advanced-indexing operation; views are exact,
so a scatter followed by a gather returns the same bytes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvtier.errors import InputError
from kvtier.layout import KVLayout


@dataclass(frozen=True)
class PagedKV:
    """The worker's per-layer KV tensors with the arithmetic to address tokens in them."""

    layers: tuple[torch.Tensor, ...]  # in model order
    layer_names: tuple[str, ...]
    kv_first: bool  # True: [2, B, N, H, D]; False: [B, H, N, 2D]
    block_size: int  # vLLM's scheduler block (block ids count in these)
    tensor_block: int  # N: tokens per block of the tensor itself
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_vllm(
        cls,
        kv_caches: Mapping[str, torch.Tensor],
        *,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
    ) -> PagedKV:
        """Recognise the layout of ``kv_caches`` (layer name -> tensor, in model order)."""
        if not kv_caches:
            raise InputError("register_kv_caches got no KV tensors; kvtier needs attention layers")
        names = tuple(kv_caches)
        layers = tuple(kv_caches[name] for name in names)
        first = layers[0]
        shape = tuple(first.shape)
        if len(shape) == 4 and shape[1] == num_kv_heads and shape[3] == 2 * head_dim:
            kv_first, tensor_block = False, shape[2]
        elif len(shape) == 5 and shape[0] == 2 and shape[3:] == (num_kv_heads, head_dim):
            kv_first, tensor_block = True, shape[2]
        else:
            raise InputError(
                f"KV cache tensor of layer {names[0]!r} has shape {shape}; kvtier reads "
                f"[blocks, {num_kv_heads}, block_tokens, {2 * head_dim}] (CPU / standardized) "
                f"or [2, blocks, block_tokens, {num_kv_heads}, {head_dim}] (flash-attention)"
            )
        for name, tensor in zip(names, layers, strict=True):
            if tuple(tensor.shape) != shape or tensor.dtype != first.dtype:
                raise InputError(
                    f"KV cache tensor of layer {name!r} is {tuple(tensor.shape)} "
                    f"{tensor.dtype}, unlike layer {names[0]!r} ({shape} {first.dtype}): "
                    "kvtier needs one layout for all layers"
                )
        if block_size % tensor_block:
            raise InputError(
                f"vLLM block_size {block_size} is not a multiple of the KV tensor's block "
                f"length {tensor_block}"
            )
        return cls(layers, names, kv_first, block_size, tensor_block, num_kv_heads, head_dim)

    def layout(self) -> KVLayout:
        return KVLayout(
            num_layers=len(self.layers),
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.layers[0].dtype,
        )

    def describe(self) -> str:
        kind = "kv-first [2,B,N,H,D]" if self.kv_first else "blocks-first [B,H,N,2D]"
        return (
            f"{len(self.layers)} layers {kind} {tuple(self.layers[0].shape)} "
            f"{self.layers[0].dtype} on {self.layers[0].device}, block {self.block_size}"
        )

    # -- addressing ------------------------------------------------------------------------
    def _slots(self, block_ids: Sequence[int], start: int, end: int) -> tuple[torch.Tensor, ...]:
        """(tensor block, offset) index tensors for token positions ``start..end-1``."""
        last_block = (end - 1) // self.block_size
        if end <= start or start < 0 or last_block >= len(block_ids):
            raise InputError(
                f"token range [{start}, {end}) is not covered by {len(block_ids)} blocks of "
                f"{self.block_size} tokens"
            )
        device = self.layers[0].device
        positions = torch.arange(start, end)
        table = torch.as_tensor(list(block_ids), dtype=torch.long)
        slots = table[positions // self.block_size] * self.block_size + positions % self.block_size
        return (
            (slots // self.tensor_block).to(device),
            (slots % self.tensor_block).to(device),
        )

    # -- copies ----------------------------------------------------------------------------
    def gather(self, block_ids: Sequence[int], start: int, end: int, out: torch.Tensor) -> None:
        """Copy tokens ``start..end-1`` of a request into ``out[:, :, start:end]``
        (``out``: ``[2, layers, >=end, kv_heads*head_dim]``, any device)."""
        blk, off = self._slots(block_ids, start, end)
        n = end - start
        hidden = self.num_kv_heads * self.head_dim
        for index, layer in enumerate(self.layers):
            if self.kv_first:
                kv = layer[:, blk, off]  # [2, n, H, D]
            else:
                # [n, H, 2D] -> [n, H, 2, D] -> [2, n, H, D]
                kv = layer[blk, :, off].view(n, self.num_kv_heads, 2, self.head_dim)
                kv = kv.permute(2, 0, 1, 3)
            out[:, index, start:end].copy_(kv.reshape(2, n, hidden), non_blocking=True)

    def scatter(self, block_ids: Sequence[int], start: int, end: int, src: torch.Tensor) -> None:
        """Write ``src[:, :, start:end]`` (a chunk-layout tensor) into the request's blocks."""
        blk, off = self._slots(block_ids, start, end)
        n = end - start
        device = self.layers[0].device
        for index, layer in enumerate(self.layers):
            kv = src[:, index, start:end].to(device, non_blocking=True)
            kv = kv.reshape(2, n, self.num_kv_heads, self.head_dim)
            if self.kv_first:
                layer[:, blk, off] = kv
            else:
                layer[blk, :, off] = kv.permute(1, 2, 0, 3).reshape(
                    n, self.num_kv_heads, 2 * self.head_dim
                )
