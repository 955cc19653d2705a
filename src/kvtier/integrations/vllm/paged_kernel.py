"""One Triton kernel launch per direction between vLLM's paged layers and a chunk tensor.

:mod:`kvtier.integrations.vllm.paged` copies with torch advanced indexing: per layer, one
gather into a temporary and one copy. On a GPU that is a kernel and a temporary per layer, and
the chunk side must be device memory (indexing cannot write into host pages). This module does
the same copy in one launch for all layers, element for element, from the tensors' strides:

    layer l, plane p, token t, head h, dim d  (planes: K and V, or one MLA latent)

    paged  layers + layer_offsets[l] + offsets[group[l], t] + p*plane + h*head + d*dim
           (offsets[g, t] = tensor block * block stride + offset in block * token stride:
            paged.py's slot formula, per KV-cache group; -1 = vLLM's null block, skipped
            by a scatter)
    chunk  chunk + p*c_plane + l*c_layer + t*c_row + (h*head_dim + d)*c_col

Grid: (token tiles, layers, planes); each program moves a ``[tokens, heads, head_dim]`` tile,
``head_dim`` innermost, where vLLM keeps it contiguous (every ``KVCacheLayout``: the content
axis is always the innermost). Layers are addressed as element offsets from the first layer,
so that the launcher sees one aligned pointer, and ``VEC`` (the widest run, up to 16 bytes,
that divides every layer offset and slot offset) lets the compiler move 16-byte vectors: a
two-byte access per thread would not reach a pinned DMA's rate over PCIe.

The chunk side may be device memory or **pinned host memory**: pinned pages are mapped into
the device's address space (unified addressing, as LMCache's kernel and vLLM's UVA views use
them), so a save can land straight in kvtier's pages with no device scratch. Elements are
moved as same-width integers: bit-exact whatever the dtype (bf16, fp8, NaN payloads).

The kernel runs on the caller's current stream, as ``copy_(non_blocking=True)`` does: who
reads the chunk side from the host waits for the stream first (``memory/device.py``'s
"landed"). Under ``TRITON_INTERPRET=1`` (set before this module is imported) the same kernels
run on CPU tensors, which is how the tests prove them bit-exact without a GPU.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from kvtier.memory.device import LANDED, Landed

Slots = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (tensor block, offset, real)
_AS_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_TILE_ELEMENTS = 4096  # elements per program: enough work per launch, registers to spare


@triton.jit  # type: ignore[untyped-decorator]  # kernels take no Python annotations
def _addresses(  # type: ignore[no-untyped-def]
    layers,
    layer_offsets,
    layer_group,
    offsets,
    chunk,
    n,
    heads,
    head_dim,
    s_plane,
    s_head,
    s_dim,
    c_plane,
    c_layer,
    c_row,
    c_col,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    VEC: tl.constexpr,
):
    """This program's tile: (paged addresses, chunk addresses, mask), ``[BLOCK_T, BLOCK_H,
    BLOCK_D]`` each. ``VEC`` divides every layer's offset and every slot offset (the host
    checked it), so a ``head_dim`` run can move as 16-byte vectors."""
    tile, layer, plane = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    group = tl.load(layer_group + layer).to(tl.int64)
    tok = tl.load(offsets + group * n + t, mask=t < n, other=-1)
    real = (t < n) & (tok >= 0)  # -1: vLLM's null block, never written
    tok = tl.multiple_of(tl.where(real, tok, 0), VEC)
    base = layers + tl.multiple_of(tl.load(layer_offsets + layer), VEC)
    paged = (
        base
        + plane.to(tl.int64) * s_plane
        + tok[:, None, None]
        + (h.to(tl.int64) * s_head)[None, :, None]  # a head may lie GiBs away (LHBNC)
        + (d * s_dim)[None, None, :]
    )
    rows = (
        chunk
        + plane.to(tl.int64) * c_plane
        + layer.to(tl.int64) * c_layer
        + (t.to(tl.int64) * c_row)[:, None, None]
        + ((h * head_dim)[None, :, None] + d[None, None, :]) * c_col
    )
    mask = real[:, None, None] & (h < heads)[None, :, None] & (d < head_dim)[None, None, :]
    return paged, rows, mask


@triton.jit  # type: ignore[untyped-decorator]
def _copy(  # type: ignore[no-untyped-def]
    layers,
    layer_offsets,
    layer_group,
    offsets,
    chunk,
    n,
    heads,
    head_dim,
    s_plane,
    s_head,
    s_dim,
    c_plane,
    c_layer,
    c_row,
    c_col,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    VEC: tl.constexpr,
    GATHER: tl.constexpr,  # True: paged blocks -> chunk rows; False: the reverse
):
    paged, rows, mask = _addresses(
        layers, layer_offsets, layer_group, offsets, chunk, n, heads, head_dim,
        s_plane, s_head, s_dim, c_plane, c_layer, c_row, c_col,
        BLOCK_T, BLOCK_H, BLOCK_D, VEC,
    )  # fmt: skip
    if GATHER:
        tl.store(rows, tl.load(paged, mask=mask), mask=mask)
    else:
        tl.store(paged, tl.load(rows, mask=mask), mask=mask)


class PagedKernel:
    """The launches for one set of layers (same shape, dtype and strides, one device).

    ``plane``, ``head`` and ``dim`` are the element strides of a token's K/V plane, head and
    dimension inside one layer tensor, ``block`` and ``token`` those of a tensor block and a
    token in it (paged.py reads them from the layout it recognised)."""

    def __init__(
        self,
        layers: Sequence[torch.Tensor],
        layer_groups: Sequence[int],
        *,
        planes: int,
        heads: int,
        head_dim: int,
        plane: int,
        head: int,
        dim: int,
        block: int,
        token: int,
    ) -> None:
        first = layers[0]
        self.device = first.device
        self.dtype = first.dtype
        self.planes, self.heads, self.head_dim = planes, heads, head_dim
        self.strides = (plane, head, dim)
        self.slot_strides = (block, token)
        self.num_layers = len(layers)
        self._int = _AS_INT[first.element_size()]
        self._first = first.view(self._int)
        # Each layer as an element offset from the first (one allocation: whole elements, see
        # ``uniform``); made once, as vLLM allocates its cache once.
        offsets = _layer_offsets(layers)
        self._layer_offsets = torch.tensor(offsets, dtype=torch.int64).to(self.device)
        groups = list(layer_groups) or [0] * len(layers)
        self._groups = torch.tensor(groups, dtype=torch.int32).to(self.device)
        block_h = triton.next_power_of_2(heads)
        block_d = triton.next_power_of_2(head_dim)
        self._blocks = (max(1, _TILE_ELEMENTS // (block_h * block_d)), block_h, block_d)
        # The widest run (up to 16 bytes) every layer start and slot offset is a multiple
        # of: the compiler may then move a head's dims as vectors, never across a boundary.
        common = math.gcd(*offsets, block, token)
        vec = 16 // first.element_size()
        while vec > 1 and common % vec:
            vec //= 2
        self.vec = vec

    @staticmethod
    def uniform(layers: Sequence[torch.Tensor]) -> bool:
        """Whether one launch can address every layer: same strides, dtype and device, each
        a whole number of elements from the first (vLLM views each layer of one allocation
        alike; anything else keeps the torch path)."""
        first = layers[0]
        size = first.element_size()
        return size in _AS_INT and all(
            t.stride() == first.stride()
            and t.dtype == first.dtype
            and t.device == first.device
            and (t.data_ptr() - first.data_ptr()) % size == 0
            for t in layers
        )

    def reaches(self, chunk: torch.Tensor) -> bool:
        """Whether the kernel can read or write ``chunk`` in place: same dtype, and on the
        layers' device or pinned host memory the device maps."""
        if chunk.dtype != self.dtype:
            return False
        if chunk.device == self.device:
            return True
        return self.device.type == "cuda" and chunk.device.type == "cpu" and chunk.is_pinned()

    def gather(self, slots: Sequence[Slots], rows: torch.Tensor) -> None:
        """``rows[p, l, t] = layer l's plane p of token t`` (``rows``: ``[planes, layers, n,
        heads*head_dim]``; ``slots``: per KV-cache group, each token's (tensor block, offset
        in it, real) on the layers' device, as paged.py draws them)."""
        self._launch(True, self._offsets(slots, skip_null=False), rows)

    def scatter(self, slots: Sequence[Slots], rows: torch.Tensor) -> None:
        """The reverse of :meth:`gather`; tokens in vLLM's null block (not ``real``) are not
        written."""
        self._launch(False, self._offsets(slots, skip_null=True), rows)

    def fence(self) -> Landed:
        """The fence after every launch queued so far on the caller's current stream: a host
        reader of a gathered page, or whoever gives back a page a scatter reads, waits for it.
        Off CUDA (the interpreter) a launch has run when it returns."""
        if self.device.type != "cuda":
            return LANDED
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self.device))
        return _EventLanded(event)

    def _offsets(self, slots: Sequence[Slots], skip_null: bool) -> torch.Tensor:
        """``[groups, n]`` element offsets of each token's slot in a layer (-1: skipped)."""
        block, token = self.slot_strides
        rows = []
        for blk, off, real in slots:
            offsets = blk * block + off * token
            rows.append(torch.where(real, offsets, -1) if skip_null else offsets)
        return torch.stack(rows)

    def _launch(self, gather: bool, offsets: torch.Tensor, rows: torch.Tensor) -> None:
        n = int(rows.shape[2])
        if n == 0:
            return
        assert tuple(rows.shape) == (self.planes, self.num_layers, n, self.heads * self.head_dim)
        assert offsets.dtype == torch.int64 and offsets.shape[1] == n
        chunk = rows.view(self._int)
        block_t, block_h, block_d = self._blocks
        grid = (triton.cdiv(n, block_t), self.num_layers, self.planes)
        plane, head, dim = self.strides
        on_cuda = self.device.type == "cuda"
        with torch.cuda.device(self.device) if on_cuda else contextlib.nullcontext():
            _copy[grid](
                self._first,
                self._layer_offsets,
                self._groups,
                offsets.contiguous(),
                chunk,
                n,
                self.heads,
                self.head_dim,
                plane,
                head,
                dim,
                *chunk.stride(),
                BLOCK_T=block_t,
                BLOCK_H=block_h,
                BLOCK_D=block_d,
                VEC=self.vec,
                GATHER=gather,
            )


class _EventLanded:
    """A CUDA event recorded after launches, as :class:`~kvtier.memory.device.Landed`."""

    def __init__(self, event: torch.cuda.Event) -> None:
        self._event = event

    def wait(self) -> None:
        self._event.synchronize()

    def done(self) -> bool:
        return bool(self._event.query())  # type: ignore[no-untyped-call]


def _layer_offsets(layers: Sequence[torch.Tensor]) -> list[int]:
    first, size = layers[0].data_ptr(), layers[0].element_size()
    return [(t.data_ptr() - first) // size for t in layers]
