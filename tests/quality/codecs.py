"""Lossy codecs built for the gate's own tests: one it must pass, one it must fail.

Both quantise each (token, head) row of ``head_dim`` elements with one absmax scale (fp32)::

    stored = scales [rows] fp32  |  q [rows, head_dim] int8          x ~= q * scale

``Int8Absmax`` keeps 255 levels (scale = absmax / 127): what a usable int8 KV codec does.
``Ternary`` keeps three (-1, 0, +1 times absmax: 1.6 bits): most elements become 0, so a
fact's key and value are lost; the gate must fail it.
"""

from __future__ import annotations

import torch

from kvtier.layout import KVLayout
from kvtier.storage.codecs import Buffer, PayloadCodec


class _AbsmaxCodec(PayloadCodec):
    lossless = False
    levels: int  # largest |q|

    def encode(self, payload: memoryview, layout: KVLayout) -> Buffer:
        rows = torch.frombuffer(payload, dtype=layout.dtype).float().view(-1, layout.head_dim)
        scale = rows.abs().amax(dim=1).clamp_min(1e-30) / self.levels
        q = (rows / scale[:, None]).round().clamp(-self.levels, self.levels).to(torch.int8)
        return scale.numpy().tobytes() + q.numpy().tobytes()

    def decode(self, stored: memoryview, out: memoryview, layout: KVLayout) -> int:
        rows = out.nbytes // (layout.dtype_bytes * layout.head_dim)
        stored = memoryview(bytearray(stored))  # torch.frombuffer wants a writable buffer
        scale = torch.frombuffer(stored, dtype=torch.float32, count=rows)
        q = torch.frombuffer(stored, dtype=torch.int8, offset=4 * rows).view(rows, -1)
        values = (q.float() * scale[:, None]).to(layout.dtype)
        target = torch.frombuffer(out, dtype=torch.uint8)
        target.copy_(values.view(-1).view(torch.uint8))
        return out.nbytes


class Int8Absmax(_AbsmaxCodec):
    codec_id = 0xFF01
    name = "test-int8-absmax"
    levels = 127


class Ternary(_AbsmaxCodec):
    codec_id = 0xFF02
    name = "test-ternary"
    levels = 1
