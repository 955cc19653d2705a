"""The lossy codecs ``fp8`` (id 2, e4m3) and ``int8`` (id 3): one byte per element plus
float32 scales, decoded back to the layout's dtype.

What is quantised. The float planes of ``full``, ``sliding`` and ``mla`` groups; a
``state`` group (a recurrent or conv state, packed bytes, :mod:`kvtier.layout`) is stored
as it is, byte for byte, inside the same record (a state is read once and carried for the
rest of the sequence: its error would compound). A page of ``n`` tokens is walked part by
part (one part of every layer, or one per group when a group trims, see
:meth:`KVLayout.page_parts`); each part's layers split into attention layers (quantised)
and state layers (raw: the last layers of the chunk tensor)::

    stored = u32 num_tokens
             then for each part, in page order:
               q        [planes, attention layers, kept tokens, hidden]   1 byte each
               scales   f32, one block per plane:
                          per token and head  [attention layers, kept tokens, heads]
                          or, int8 keys only, per channel  [attention layers, hidden]
               raw      the part's state layers, as in the page

Scales, measured (docs/codecs.md; relative L2 error on the synthetic KV of
``kvtier.bench.codec``, keys with outlier channels and RoPE): values (and an MLA latent,
planes 1) are scaled per token and head (the amax over ``head_dim``). Keys: KIVI scales
them per channel (the amax of one channel of one layer over the chunk's tokens), and for
int8 that halves the key error (0.65 % against 1.27 % per token and head); for fp8 it does
not (2.64 % against 2.29 %: e4m3's exponent already spans the channels' range), so fp8
keys are scaled per token and head like values. ``scale = amax / QMAX`` (448 for e4m3,
127 for int8); a zero amax stores scale 1.

Sizes are exact: ``stored_bytes(layout, n)`` is the payload's element count plus 4 bytes
per scale plus the raw state bytes and 4; a stored length other than that is corrupt
(:class:`CorruptRecord`), so a cut stream never decodes. The stored bytes' xxh3 is checked
by the record before decode runs.

A lossy codec changes what a reader gets back: a tier writing one runs under a fingerprint
that names it (:func:`kvtier.storage.codecs.tier_fingerprint`), so a reader configured with
another codec never takes these chunks as its own. The work is torch and numpy ops on views
of the page, a few layers at a time (both release the GIL inside each op); Python loops
only over those blocks of layers.
"""

from __future__ import annotations

import struct
import warnings
from abc import abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.errors import CorruptRecord
from kvtier.layout import GroupKind, KVLayout
from kvtier.storage.codecs.base import PayloadCodec

# A record read from redis arrives as immutable bytes; torch warns (once) that the tensor
# viewing them is read-only. Decode only reads them.
warnings.filterwarnings("ignore", message="The given buffer is not writable", module=__name__)

_COUNT = struct.Struct("<I")
_SCALE = torch.float32
# Elements converted per step (1 MiB of float32): large chunks (32 MiB of bf16) went 5x
# slower done whole, their float32 temporaries far outside the CPU cache.
_BLOCK = 1 << 18


@dataclass(frozen=True, slots=True)
class _Part:
    """One part of a page: its byte span and how many of its layers are attention."""

    at: int  # byte offset in the page
    layers: int  # layers in the part
    attention: int  # the first ``attention`` layers are quantised, the rest are raw state
    tokens: int  # tokens kept in the part


def _parts(layout: KVLayout, num_tokens: int) -> list[_Part]:
    out = []
    per_layer_token = layout.planes * layout.hidden * layout.dtype_bytes
    spans = layout.page_parts(num_tokens)
    # One part of every layer unless a group trims; then state layers are the last ones.
    groups = list(layout.groups) if layout.trims else [None]
    state_layers = sum(len(g.layers) for g in layout.groups if g.kind == GroupKind.STATE)
    for (_, at, nbytes), group in zip(spans, groups, strict=True):
        if group is None:
            layers, attention = layout.num_layers, layout.num_layers - state_layers
        else:
            layers = len(group.layers)
            attention = 0 if group.kind == GroupKind.STATE else layers
        tokens = nbytes // (per_layer_token * layers)
        out.append(_Part(at, layers, attention, tokens))
    return out


def _tokens_of(layout: KVLayout, nbytes: int) -> int:
    """The token count whose payload is ``nbytes`` (payload_bytes grows with n), or -1."""
    lo, hi = 1, nbytes // (layout.planes * layout.hidden * layout.dtype_bytes) + 1
    while lo < hi:
        mid = (lo + hi) // 2
        if layout.payload_bytes(mid) < nbytes:
            lo = mid + 1
        else:
            hi = mid
    return lo if layout.payload_bytes(lo) == nbytes else -1


def _amax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """max |x| along ``dim``: two vectorised reductions and no |x| tensor (on one core,
    0.7 ms for 2M floats, where ``vector_norm(ord=inf)`` takes 11 ms and ``abs().amax``
    1.2 ms)."""
    return torch.maximum(x.amax(dim), x.amin(dim).neg_())


def _typed_bytes(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``raw`` (uint8) as ``dtype``: a view where its offset allows one, else a copy (a
    section after an odd number of quantised bytes)."""
    if raw.storage_offset() % torch.empty((), dtype=dtype).element_size():
        raw = raw.clone()
    return raw.view(dtype)


class QuantizedCodec(PayloadCodec):
    """One byte per element with float32 scales (module docstring); subclasses name the
    byte format."""

    lossless = False
    qmax: float
    unit = 1.0  # what _dequantize's values are to be multiplied by (folded into the scales)
    keys_per_channel: bool  # else keys are scaled per token and head, as values are

    @abstractmethod
    def _quantize(self, scaled: torch.Tensor) -> torch.Tensor:
        """Float32 values within +-qmax to their bytes (uint8, same shape)."""

    @abstractmethod
    def _dequantize(self, q: torch.Tensor) -> torch.Tensor:
        """Bytes (uint8) to float32 values over ``unit``, a new tensor."""

    # -- sizes ------------------------------------------------------------------------------
    def _scale_count(self, layout: KVLayout, part: _Part) -> tuple[int, int]:
        """(key scales, per-token scales) of a part's attention layers."""
        if not part.attention:
            return 0, 0
        per_token = part.attention * part.tokens * layout.num_kv_heads
        if layout.planes == 1:
            return 0, per_token
        return (part.attention * layout.hidden if self.keys_per_channel else per_token), per_token

    def stored_bytes(self, layout: KVLayout, num_tokens: int) -> int:
        """Exactly what :meth:`encode` stores for a page of ``num_tokens``."""
        total = _COUNT.size
        for part in _parts(layout, num_tokens):
            k, v = self._scale_count(layout, part)
            elements = layout.planes * part.attention * part.tokens * layout.hidden
            raw = layout.planes * (part.layers - part.attention) * part.tokens * layout.hidden
            total += elements + 4 * (k + v) + raw * layout.dtype_bytes
        return total

    # -- the codec --------------------------------------------------------------------------
    def encode(self, payload: memoryview, layout: KVLayout) -> memoryview:
        num_tokens = _tokens_of(layout, payload.nbytes)
        if num_tokens < 0:
            raise ValueError(f"{payload.nbytes} bytes are no page of layout {layout.describe()}")
        page = torch.frombuffer(payload, dtype=torch.uint8)
        out = torch.empty(self.stored_bytes(layout, num_tokens), dtype=torch.uint8)
        out[: _COUNT.size] = torch.frombuffer(bytearray(_COUNT.pack(num_tokens)), dtype=torch.uint8)
        at = _COUNT.size
        for part in _parts(layout, num_tokens):
            typed = self._typed(page, layout, part)
            if part.attention:
                at = self._encode_attention(typed[:, : part.attention], layout, out, at)
            raw = typed[:, part.attention :].contiguous().view(torch.uint8).reshape(-1)
            out[at : at + raw.numel()] = raw
            at += raw.numel()
        assert at == out.numel()
        return memoryview(out.numpy())  # type: ignore[arg-type]  # keeps ``out`` alive

    def decode(self, stored: memoryview, out: memoryview, layout: KVLayout) -> int:
        num_tokens = _tokens_of(layout, out.nbytes)
        if stored.nbytes < _COUNT.size or num_tokens < 0:
            raise CorruptRecord(f"{self.name} record of {stored.nbytes} bytes cannot be read")
        (count,) = _COUNT.unpack_from(stored)
        if count != num_tokens or stored.nbytes != self.stored_bytes(layout, num_tokens):
            raise CorruptRecord(
                f"{self.name} record holds {stored.nbytes} bytes for {count} tokens; "
                f"a page of {out.nbytes} bytes needs {self.stored_bytes(layout, num_tokens)}"
            )
        src = torch.frombuffer(stored, dtype=torch.uint8)
        page = torch.frombuffer(out, dtype=torch.uint8)
        at = _COUNT.size
        for part in _parts(layout, num_tokens):
            typed = self._typed(page, layout, part)
            if part.attention:
                at = self._decode_attention(src, at, layout, typed[:, : part.attention])
            raw = typed[:, part.attention :]
            n = raw.numel() * layout.dtype_bytes
            raw.copy_(_typed_bytes(src[at : at + n], layout.dtype).view(raw.shape))
            at += n
        return out.nbytes

    # -- one part ---------------------------------------------------------------------------
    @staticmethod
    def _typed(page: torch.Tensor, layout: KVLayout, part: _Part) -> torch.Tensor:
        n = layout.planes * part.layers * part.tokens * layout.hidden * layout.dtype_bytes
        shape = (layout.planes, part.layers, part.tokens, layout.hidden)
        return page[part.at : part.at + n].view(layout.dtype).view(shape)

    def _encode_attention(
        self, kv: torch.Tensor, layout: KVLayout, out: torch.Tensor, at: int
    ) -> int:
        """Quantise ``kv`` ([planes, layers, tokens, hidden]) into ``out`` from ``at``: the
        bytes straight into ``out``, then the scales. A few layers at a time (_BLOCK), so
        the float32 temporaries stay in the CPU cache."""
        planes, layers, tokens, hidden = kv.shape
        heads = (layout.num_kv_heads, layout.head_dim)
        q = out[at : at + kv.numel()].view(kv.shape)
        at += kv.numel()
        step = max(1, _BLOCK // (tokens * hidden))
        for plane in range(planes):
            per_channel = plane == 0 and planes == 2 and self.keys_per_channel
            shape = (layers, hidden) if per_channel else (layers, tokens, heads[0])
            scales = torch.empty(shape, dtype=_SCALE)
            for lo in range(0, layers, step):
                hi = min(layers, lo + step)
                x = kv[plane, lo:hi].to(torch.float32, copy=True)  # scaled in place
                if per_channel:
                    scale = scales[lo:hi]
                    scale.copy_(self._scale(_amax(x, 1)))
                    q[plane, lo:hi] = self._quantize(x.div_(scale.unsqueeze(1)))
                else:
                    split = x.view(hi - lo, tokens, *heads)
                    scale = scales[lo:hi]
                    scale.copy_(self._scale(_amax(split, -1)))
                    q[plane, lo:hi] = self._quantize(split.div_(scale.unsqueeze(-1)).view(x.shape))
            block = scales.view(-1).view(torch.uint8)
            out[at : at + block.numel()] = block
            at += block.numel()
        return at

    def _decode_attention(
        self, src: torch.Tensor, at: int, layout: KVLayout, dst: torch.Tensor
    ) -> int:
        """Dequantise from ``src[at:]`` into ``dst`` ([planes, layers, tokens, hidden]), a
        few layers at a time (_BLOCK)."""
        planes, layers, tokens, hidden = dst.shape
        heads = (layout.num_kv_heads, layout.head_dim)
        q = src[at : at + dst.numel()].view(dst.shape)
        at += dst.numel()
        step = max(1, _BLOCK // (tokens * hidden))
        for plane in range(planes):
            per_channel = plane == 0 and planes == 2 and self.keys_per_channel
            shape = (layers, 1, hidden) if per_channel else (layers, tokens, heads[0], 1)
            count = layers * hidden if per_channel else layers * tokens * heads[0]
            scales = (_typed_bytes(src[at : at + 4 * count], _SCALE) * self.unit).view(shape)
            at += 4 * count
            for lo in range(0, layers, step):
                hi = min(layers, lo + step)
                values = self._dequantize(q[plane, lo:hi])  # float32, over ``unit``
                if per_channel:
                    values.mul_(scales[lo:hi])
                else:
                    values.view(hi - lo, tokens, *heads).mul_(scales[lo:hi])
                dst[plane, lo:hi].copy_(values)
        return at

    def _scale(self, amax: torch.Tensor) -> torch.Tensor:
        scale = (amax / self.qmax).to(_SCALE)
        return torch.where(scale > 0, scale, torch.ones_like(scale)).contiguous()


class Fp8Codec(QuantizedCodec):
    """e4m3 (``torch.float8_e4m3fn``): 3 mantissa bits, relative error <= 1/16 per element
    above the subnormal range."""

    codec_id = 2
    name = "fp8"
    qmax = 448.0
    keys_per_channel = False  # e4m3's own exponent covers the channels' range (measured)

    unit = 256.0  # 2**(15 - 7): float16's exponent bias over e4m3's

    def _quantize(self, scaled: torch.Tensor) -> torch.Tensor:
        # |scaled| <= 448 by the scale's choice (no clamp pass); e4m3fn has no infinity.
        return scaled.to(torch.float8_e4m3fn).view(torch.uint8)

    def _dequantize(self, q: torch.Tensor) -> torch.Tensor:
        """e4m3 bits moved into float16 bits: the value over 256, subnormals included::

            e4m3   s eeee mmm                 (bias 7)
            int8 -> int16 sign-extends:  s...s s eeee mmm
            << 7                         s s eeee mmm 0000000     bit 14 is a copy of s
            & 0xBF80                     s 0 eeee mmm 0000000     float16, bias 15: / 2**8

        Three numpy passes in place (the GIL released): 7x torch's own float8 conversion
        on one core. A NaN byte (never written: the scale bounds every value) decodes
        finite."""
        wide = q.numpy().view(np.int8).astype(np.int16)
        np.left_shift(wide, 7, out=wide)
        np.bitwise_and(wide, np.int16(-0x4080), out=wide)  # 0xBF80 as int16
        return torch.from_numpy(wide.view(np.float16)).to(torch.float32)


class Int8Codec(QuantizedCodec):
    """Symmetric int8: round to nearest of 255 levels, error <= scale / 2 per element."""

    codec_id = 3
    name = "int8"
    qmax = 127.0
    keys_per_channel = True  # halves the key error against scales per token (measured)

    def _quantize(self, scaled: torch.Tensor) -> torch.Tensor:
        # |scaled| <= 127 by the scale's choice: no clamp pass
        return scaled.round_().to(torch.int8).view(torch.uint8)

    def _dequantize(self, q: torch.Tensor) -> torch.Tensor:
        return q.view(torch.int8).to(torch.float32)


FP8 = Fp8Codec()
INT8 = Int8Codec()
