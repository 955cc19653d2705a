"""A context's KV through a codec, chunk by chunk, as a tier stores and loads it.

::

    kv [planes, layers, tokens, hidden]   (model dtype; cast to the layout's dtype first)
      │ for each chunk of ``chunk_size`` tokens (the last one partial):
      ├─ layout.pack      chunk -> page (flat uint8, layout.payload_bytes(n))
      ├─ codec.encode     page  -> stored bytes           what the record writer keeps
      ├─ codec.decode     stored -> a fresh page           must fill payload_bytes(n)
      └─ layout.unpack    page  -> the chunk's tokens of the result
    result [planes, layers, tokens, hidden]   (cast back to kv's dtype)

This is the part of :mod:`kvtier.storage.records` a codec sees (the header and checksum
around it are the record format's, not the codec's, and cannot change the KV), so the gate
measures exactly what a model would get back from any tier. The stored bytes are counted so
the gate can report the ratio it measured with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.errors import InputError
from kvtier.layout import KVLayout
from kvtier.storage.codecs import PayloadCodec


@dataclass(frozen=True, slots=True)
class RoundTrip:
    kv: torch.Tensor  # what came back, in the input's dtype
    payload_bytes: int  # pages in
    stored_bytes: int  # what the codec stored for them


def through_codec(
    kv: torch.Tensor, layout: KVLayout, codec: PayloadCodec, chunk_size: int
) -> RoundTrip:
    """``kv`` (``layout.kv_shape(tokens)``) after encode and decode by ``codec``."""
    if tuple(kv.shape) != layout.kv_shape(kv.shape[2]):
        raise InputError(f"KV of shape {tuple(kv.shape)} does not fit {layout.describe()}")
    stored_kv = kv.to(layout.dtype)
    back = torch.empty_like(stored_kv)
    tokens = kv.shape[2]
    payload = stored = 0
    for start in range(0, tokens, chunk_size):
        chunk = stored_kv[:, :, start : start + chunk_size]
        nbytes = layout.payload_bytes(chunk.shape[2])
        page = torch.empty(nbytes, dtype=torch.uint8)
        layout.pack(chunk, page)
        encoded = memoryview(codec.encode(_bytes_of(page), layout)).cast("B")
        out = torch.empty(nbytes, dtype=torch.uint8)
        written = codec.decode(encoded, _bytes_of(out), layout)
        if written != nbytes:
            raise InputError(
                f"codec {codec.name!r} decoded {written} bytes of a {nbytes}-byte page"
            )
        layout.unpack(out, back[:, :, start : start + chunk_size])
        payload += nbytes
        stored += encoded.nbytes
    return RoundTrip(back.to(kv.dtype), payload, stored)


def _bytes_of(page: torch.Tensor) -> memoryview:
    return memoryview(page.numpy())  # type: ignore[arg-type]
