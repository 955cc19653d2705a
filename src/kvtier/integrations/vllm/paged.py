"""vLLM's paged KV cache <-> kvtier chunk pages: gather and scatter by token position.

vLLM hands the worker one tensor per attention layer (``register_kv_caches``). Two layouts
are recognised from the tensors' shapes, never assumed::

    blocks-first  [num_blocks, kv_heads, block_tokens, 2*head_dim]   K | V side by side in
                  (vLLM's standardized [B, H, N, C] view; the CPU     the last dimension
                  attention backend's native layout)
    kv-first      [2, num_blocks, block_tokens, kv_heads, head_dim]  K and V planes
                  (CUDA flash-attention's classic layout)
    latent        [num_blocks, 1, block_tokens, latent_dim]          MLA: one latent vector
                  or [num_blocks, block_tokens, latent_dim]          per token (e.g. 512+64)

kvtier's chunk page is ``[2, layers, tokens, kv_heads*head_dim]`` (``[1, layers, tokens,
latent_dim]`` for MLA).

With vLLM's hybrid KV cache manager, layers belong to KV-cache groups and each group has its
own block table: ``block_ids`` is then one list per group (``layer_groups[i]`` says which
list layer ``i`` reads). A sliding-window group's blocks before the window are vLLM's null
block (id 0, shared padding): a scatter never writes there, and :meth:`PagedKV.complete`
says whether a token range still has real blocks in every group (a save needs that). A
sliding group stores only the last ``keep`` tokens of each chunk
(:func:`~kvtier.layout.sliding_keep`); :meth:`PagedKV.restorable` checks that vLLM holds
the null block wherever a load has nothing.

A token at position ``p`` of a request lives in the request's block
``block_ids[p // block_size]`` at offset ``p % block_size``; its slot is
``block_id * block_size + offset``. The tensor's own block
(``block_tokens``) may be smaller than vLLM's scheduler block when the kernel splits it, so
the slot is re-divided by the tensor's block length::

    position p ──▶ slot = block_ids[p // bs] * bs + p % bs ──▶ (slot // N, slot % N) in the tensor

Both directions copy each layer once with one advanced-indexing operation; views are exact,
so a scatter followed by a gather returns the same bytes. On a CUDA device the same copy is
one Triton launch for all layers (:mod:`~kvtier.integrations.vllm.paged_kernel`), which also
reads and writes pinned host pages in place; the torch path stays for CPU hosts and for a
chunk tensor the kernel cannot reach (another dtype, pageable host memory).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, cast

import torch

from kvtier.errors import InputError
from kvtier.layout import GroupKind, KVGroup, KVLayout, sliding_keep

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from kvtier.integrations.vllm.paged_kernel import PagedKernel

NULL_BLOCK = 0  # vLLM's shared null block: padding for blocks a group no longer holds

# One block table (every group shares it) or one table per KV-cache group.
BlockIds = Sequence[int] | Sequence[Sequence[int]]


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
    planes: int = 2  # 1: MLA latent [B, 1, N, D] (or [B, N, D]: viewed as [B, 1, N, D])
    layer_groups: tuple[int, ...] = ()  # per layer: its KV-cache group (block table)
    groups: tuple[KVGroup, ...] = ()  # the layout's groups (default: one of every layer)
    kernel: PagedKernel | None = field(default=None, compare=False, repr=False)  # CUDA copies

    @classmethod
    def from_vllm(
        cls,
        kv_caches: Mapping[str, torch.Tensor],
        *,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        mla: bool = False,
        groups: Sequence[tuple[GroupKind, int, Sequence[str]]] = (),
    ) -> PagedKV:
        """Recognise the layout of ``kv_caches`` (layer name -> tensor, in model order).

        ``mla``: the model caches one latent of ``head_dim`` per token (vLLM's
        ``use_mla``). ``groups``: vLLM's KV-cache groups in order, as (kind, window, layer
        names); empty means one full-attention (or MLA) group of every layer."""
        if not kv_caches:
            raise InputError("register_kv_caches got no KV tensors; kvtier needs attention layers")
        names = tuple(kv_caches)
        layers = tuple(kv_caches[name] for name in names)
        first = layers[0]
        shape = tuple(first.shape)
        planes = 2
        if mla and len(shape) == 3 and shape[2] == head_dim:
            layers = tuple(t.unsqueeze(1) for t in layers)
            shape = tuple(layers[0].shape)
        if mla and len(shape) == 4 and shape[1] == 1 and shape[3] == head_dim:
            kv_first, tensor_block, planes, num_kv_heads = False, shape[2], 1, 1
        elif len(shape) == 4 and shape[1] == num_kv_heads and shape[3] == 2 * head_dim:
            kv_first, tensor_block = False, shape[2]
        elif len(shape) == 5 and shape[0] == 2 and shape[3:] == (num_kv_heads, head_dim):
            kv_first, tensor_block = True, shape[2]
        else:
            latent = f" or [blocks, 1, block_tokens, {head_dim}] (MLA latent)" if mla else ""
            raise InputError(
                f"KV cache tensor of layer {names[0]!r} has shape {shape}; kvtier reads "
                f"[blocks, {num_kv_heads}, block_tokens, {2 * head_dim}] (CPU / standardized) "
                f"or [2, blocks, block_tokens, {num_kv_heads}, {head_dim}] (flash-attention)"
                f"{latent}"
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
        layer_groups, kv_groups = _layer_groups(names, groups, block_size)
        paged = cls(
            layers,
            names,
            kv_first,
            block_size,
            tensor_block,
            num_kv_heads,
            head_dim,
            planes,
            layer_groups,
            kv_groups,
        )
        if first.device.type != "cuda":
            return paged
        try:
            return paged.with_kernel()
        except ImportError as exc:  # a CUDA build without Triton: the torch path still works
            log.warning("kvtier: no Triton (%s); vLLM's blocks are copied with torch", exc)
            return paged

    def with_kernel(self) -> PagedKV:
        """This paged KV copying through the Triton kernel (unchanged if its layers cannot
        share one launch). Imports Triton: on a CPU host only the tests call it, under
        ``TRITON_INTERPRET=1``."""
        from kvtier.integrations.vllm.paged_kernel import PagedKernel

        if not PagedKernel.uniform(self.layers):
            return self
        s = self.layers[0].stride()
        block, token = (s[1], s[2]) if self.kv_first and self.planes == 2 else (s[0], s[2])
        if self.planes == 1:  # [B, 1, N, D]
            plane, head, dim = 0, 0, s[3]
        elif self.kv_first:  # [2, B, N, H, D]
            plane, head, dim = s[0], s[3], s[4]
        else:  # [B, H, N, 2D]: K then V along the last axis
            plane, head, dim = self.head_dim * s[3], s[1], s[3]
        kernel = PagedKernel(
            self.layers,
            self.layer_groups,
            planes=self.planes,
            heads=self.num_kv_heads,
            head_dim=self.head_dim,
            plane=plane,
            head=head,
            dim=dim,
            block=block,
            token=token,
        )
        return replace(self, kernel=kernel)

    def layout(self) -> KVLayout:
        return KVLayout(
            num_layers=len(self.layers),
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.layers[0].dtype,
            planes=self.planes,
            groups=self.groups,
        )

    @property
    def num_groups(self) -> int:
        return max(self.layer_groups, default=0) + 1

    def tables(self, block_ids: BlockIds) -> tuple[Sequence[int], ...]:
        """``block_ids`` as one table per group (a flat list is the table of every group)."""
        if block_ids and not isinstance(block_ids[0], int):
            tables = tuple(cast(Sequence[Sequence[int]], block_ids))
        else:
            tables = (cast(Sequence[int], block_ids),) * self.num_groups
        if len(tables) != self.num_groups:
            raise InputError(
                f"got {len(tables)} block tables for {self.num_groups} KV-cache groups"
            )
        return tables

    def complete(self, block_ids: BlockIds, start: int, end: int, chunk_size: int = 0) -> bool:
        """Whether every group still has a real block (not the null block) for every token
        of ``start..end-1`` that it stores: a sliding-window group drops blocks behind its
        window, and a trimmed one (``keep``) stores only the last ``keep`` tokens of each
        chunk of ``chunk_size`` (whole chunks: a save)."""
        first, last = start // self.block_size, (end - 1) // self.block_size
        for table, group in zip(self.tables(block_ids), self._table_groups(), strict=True):
            if len(table) <= last:
                return False
            if group is not None and group.keep and chunk_size:
                _, _, real = self._slots(table, start, end)
                ends = _chunk_ends(start, end, chunk_size, end)
                stored = torch.arange(start, end) >= ends - group.keep
                if not bool(real.cpu()[stored].all()):
                    return False
            elif NULL_BLOCK in table[first : last + 1]:
                return False
        return True

    def restorable(
        self, block_ids: BlockIds, start: int, end: int, chunk_size: int, num_tokens: int
    ) -> bool:
        """Whether a load of ``start..end-1`` fills every real block it writes: a trimmed
        group (``keep``) holds only the last ``keep`` tokens before each chunk's end (chunks
        of ``chunk_size``, the last one ending at ``num_tokens``), and vLLM must have the
        null block wherever it did not keep (what vLLM's sliding-window manager does for
        tokens behind the window of a resume at ``end`` or one block before)."""
        for table, group in zip(self.tables(block_ids), self._table_groups(), strict=True):
            if group is None or not group.keep or end <= start:
                continue
            _, _, real = self._slots(table, start, end)
            ends = _chunk_ends(start, end, chunk_size, num_tokens)
            missing = torch.arange(start, end) < ends - group.keep
            if bool(real.cpu()[missing].any()):
                return False
        return True

    def _table_groups(self) -> list[KVGroup | None]:
        """The layout's group of each block table (None: one table for every layer)."""
        if len(self.groups) == self.num_groups:
            return list(self.groups)
        return [None] * self.num_groups

    def describe(self) -> str:
        kind = "kv-first [2,B,N,H,D]" if self.kv_first else "blocks-first [B,H,N,2D]"
        if self.planes == 1:
            kind = "MLA latent [B,1,N,D]"
        if self.num_groups > 1:
            kind += f", groups {self.layout().describe_groups()}"
        return (
            f"{len(self.layers)} layers {kind} {tuple(self.layers[0].shape)} "
            f"{self.layers[0].dtype} on {self.layers[0].device}, block {self.block_size}"
        )

    # -- addressing ------------------------------------------------------------------------
    def _slots(
        self, block_ids: Sequence[int], start: int, end: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tensor block, offset, real) for token positions ``start..end-1``; ``real`` is
        False where the table holds the null block (nothing to read or write there)."""
        last_block = (end - 1) // self.block_size
        if end <= start or start < 0 or last_block >= len(block_ids):
            raise InputError(
                f"token range [{start}, {end}) is not covered by {len(block_ids)} blocks of "
                f"{self.block_size} tokens"
            )
        device = self.layers[0].device
        positions = torch.arange(start, end)
        table = torch.as_tensor(list(block_ids), dtype=torch.long)
        blocks = table[positions // self.block_size]
        slots = blocks * self.block_size + positions % self.block_size
        return (
            (slots // self.tensor_block).to(device),
            (slots % self.tensor_block).to(device),
            (blocks != NULL_BLOCK).to(device),
        )

    def _group_slots(
        self, block_ids: BlockIds, start: int, end: int
    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        tables = self.tables(block_ids)
        if len(self.groups) <= 1 or all(t is tables[0] for t in tables):
            return [self._slots(tables[0], start, end)] * len(tables)
        return [self._slots(table, start, end) for table in tables]

    # -- copies ----------------------------------------------------------------------------
    def gather(
        self, block_ids: BlockIds, start: int, end: int, out: torch.Tensor, base: int = 0
    ) -> None:
        """Copy tokens ``start..end-1`` of a request into ``out[:, :, start-base:end-base]``
        (``out``: ``[planes, layers, >=end-base, kv_heads*head_dim]``, row 0 token ``base``,
        any device). The caller checks :meth:`complete` first where groups may hold the null
        block."""
        slots = self._group_slots(block_ids, start, end)
        rows = out[:, :, start - base : end - base]
        if self.kernel is not None and self.kernel.reaches(rows):
            self.kernel.gather(slots, rows)
            return
        n = end - start
        hidden = self.num_kv_heads * self.head_dim
        for index, layer in enumerate(self.layers):
            blk, off, _ = slots[self.layer_groups[index] if self.layer_groups else 0]
            if self.planes == 1:
                kv = layer[blk, 0, off].unsqueeze(0)  # [1, n, D]
            elif self.kv_first:
                kv = layer[:, blk, off]  # [2, n, H, D]
            else:
                # [n, H, 2D] -> [n, H, 2, D] -> [2, n, H, D]
                kv = layer[blk, :, off].view(n, self.num_kv_heads, 2, self.head_dim)
                kv = kv.permute(2, 0, 1, 3)
            rows = out[:, index, start - base : end - base]
            rows.copy_(kv.reshape(self.planes, n, hidden), non_blocking=True)

    def scatter(
        self, block_ids: BlockIds, start: int, end: int, src: torch.Tensor, base: int = 0
    ) -> None:
        """Write tokens ``start..end-1`` of ``src`` (a chunk-layout tensor whose row 0 is
        token ``base``) into the request's blocks; positions a group maps to the null block
        are skipped."""
        slots = self._group_slots(block_ids, start, end)
        rows = src[:, :, start - base : end - base]
        if self.kernel is not None and self.kernel.reaches(rows):
            self.kernel.scatter(slots, rows)
            return
        n = end - start
        device = self.layers[0].device
        for index, layer in enumerate(self.layers):
            blk, off, real = slots[self.layer_groups[index] if self.layer_groups else 0]
            kv = src[:, index, start - base : end - base].to(device, non_blocking=True)
            if not bool(real.all()):
                blk, off, kv, m = blk[real], off[real], kv[:, real], int(real.sum())
            else:
                m = n
            if m == 0:
                continue
            if self.planes == 1:
                layer[blk, 0, off] = kv[0]
                continue
            kv = kv.reshape(2, m, self.num_kv_heads, self.head_dim)
            if self.kv_first:
                layer[:, blk, off] = kv
            else:
                layer[blk, :, off] = kv.permute(1, 2, 0, 3).reshape(
                    m, self.num_kv_heads, 2 * self.head_dim
                )


def _layer_groups(
    names: tuple[str, ...],
    groups: Sequence[tuple[GroupKind, int, Sequence[str]]],
    block_size: int,
) -> tuple[tuple[int, ...], tuple[KVGroup, ...]]:
    """Per layer (in ``names`` order) its group index, and the layout's groups (a sliding
    group keeps :func:`~kvtier.layout.sliding_keep` tokens of each chunk)."""
    if not groups:
        return (0,) * len(names), ()
    where: dict[str, int] = {}
    for gi, (_, _, layer_names) in enumerate(groups):
        for name in layer_names:
            where[name] = gi
    missing = [n for n in names if n not in where]
    if missing:
        raise InputError(
            f"KV cache layers {missing} are in no KV-cache group of {[list(g[2]) for g in groups]}"
        )
    layer_groups = tuple(where[n] for n in names)
    kv_groups = tuple(
        KVGroup(
            kind,
            tuple(i for i, g in enumerate(layer_groups) if g == gi),
            window if kind == GroupKind.SLIDING else 0,
            keep=sliding_keep(window, block_size) if kind == GroupKind.SLIDING else 0,
        )
        for gi, (kind, window, _) in enumerate(groups)
    )
    return layer_groups, kv_groups


def _chunk_ends(start: int, end: int, chunk_size: int, num_tokens: int) -> torch.Tensor:
    """For each position in ``start..end-1``: the end of its chunk (the last chunk ends at
    ``num_tokens``)."""
    positions = torch.arange(start, end)
    return torch.clamp((positions // chunk_size + 1) * chunk_size, max=num_tokens)
