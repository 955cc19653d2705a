"""How a reader checks a record's stored bytes and lands its payload in a page (the record
format itself: :mod:`kvtier.storage.records`).

A reader that streams the stored bytes (a file, a socket) lands them where
:func:`stored_target` says (the page itself for identity: no copy), hashes them as they
arrive (:func:`payload_hasher`), then :func:`finish_read` checks the digest and decodes into
the page; a record held whole in memory (a Redis or S3 value) goes through
:func:`decode_record_into`. Every path raises :class:`~kvtier.errors.CorruptRecord` for bytes
that are not the ones stored: a miss, never data.
"""

from __future__ import annotations

import numpy as np
import torch
import xxhash

from kvtier.errors import CorruptRecord
from kvtier.fingerprint import Fingerprint
from kvtier.keys import ChunkKey
from kvtier.layout import KVLayout
from kvtier.storage.records import (
    HEADER_SIZE,
    RecordHeader,
    decode_header,
    payload_checksum,
    payload_view,
)


def verify_stored(
    header: RecordHeader,
    stored: torch.Tensor | memoryview | bytes,
    layout: KVLayout | None = None,
) -> None:
    """Raise :class:`CorruptRecord` unless ``stored`` is exactly the bytes ``header`` names
    (with ``layout``, the message names the KV-cache group whose part differs)."""
    view = payload_view(stored)
    if view.nbytes != header.stored_len:
        raise CorruptRecord(f"record stores {view.nbytes} bytes, header says {header.stored_len}")
    check_stored_digest(header, payload_checksum(view), view, layout)


def payload_hasher() -> xxhash.xxh3_128:
    """A streaming stored checksum: ``update`` it with the stored bytes in order, in pieces
    of any size, while they are still in the CPU cache (as they land from a socket or a
    file); its ``digest()`` equals :func:`payload_checksum` of the whole."""
    return xxhash.xxh3_128()


def check_stored_digest(
    header: RecordHeader,
    digest: bytes,
    stored: torch.Tensor | memoryview | bytes | None = None,
    layout: KVLayout | None = None,
) -> None:
    """Raise :class:`CorruptRecord` unless ``digest`` (of all the stored bytes) is the
    header's. On a mismatch, given the ``stored`` bytes and the ``layout``, the message names
    the KV-cache group whose part differs (the record's part checksums, identity only)."""
    if digest != header.stored_checksum:
        where = ""
        if stored is not None and layout is not None:
            where = _failed_parts(header, payload_view(stored), layout)
        raise CorruptRecord(f"payload checksum mismatch for key {header.key.hex()}{where}")


def _failed_parts(header: RecordHeader, view: memoryview, layout: KVLayout) -> str:
    parts = layout.page_parts(header.num_tokens)
    if len(parts) != len(header.part_checksums) or view.nbytes < header.payload_len:
        return ""
    bad = [
        name
        for (name, at, n), want in zip(parts, header.part_checksums, strict=True)
        if xxhash.xxh3_64_intdigest(view[at : at + n]) != want
    ]
    return f" in KV-cache group {', '.join(bad)}" if bad else ""


def stored_target(header: RecordHeader, out: torch.Tensor) -> memoryview:
    """Where a reader lands the stored bytes of ``header``'s record, for a page ``out``
    (flat uint8, at least the payload's size): the page itself for identity (no copy), a
    new scratch buffer of the stored length for any other codec (:func:`finish_read` then
    decodes it into the page)."""
    _check_out(header, out)
    if header.codec.is_identity:
        return memoryview(out[: header.payload_len].numpy())  # type: ignore[arg-type]
    return memoryview(bytearray(header.stored_len))


def finish_read(
    header: RecordHeader,
    digest: bytes,
    stored: memoryview,
    out: torch.Tensor,
    layout: KVLayout,
) -> None:
    """After the stored bytes landed in ``stored`` (from :func:`stored_target`) and were
    hashed to ``digest``: check the digest, then decode into ``out`` unless they already are
    the payload there (identity). Raises :class:`CorruptRecord` (out may hold bytes of the
    failed read)."""
    check_stored_digest(header, digest, stored, layout)
    if header.codec.is_identity and _address(stored) == out.data_ptr():
        return  # read in place: the page holds the payload
    _decode_into(header, stored, out, layout)


def _decode_into(
    header: RecordHeader, stored: memoryview, out: torch.Tensor, layout: KVLayout
) -> None:
    """The codec's decode into the page, its length checked against the payload's."""
    _check_out(header, out)
    target = memoryview(out[: header.payload_len].numpy())  # type: ignore[arg-type]
    written = header.codec.decode(stored, target, layout)
    if written != header.payload_len:
        raise CorruptRecord(
            f"{header.codec.name} decoded {written} bytes, the payload is {header.payload_len}"
        )


def _check_out(header: RecordHeader, out: torch.Tensor) -> None:
    if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < header.payload_len:
        raise ValueError(f"out must be a flat uint8 tensor of >= {header.payload_len} bytes")


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if view.nbytes else 0


def decode_record_into(
    buf: bytes | bytearray | memoryview,
    fingerprint: Fingerprint,
    expected_key: ChunkKey | None,
    out: torch.Tensor,
) -> int:
    """Check a whole record held in memory and decode its payload into ``out`` (flat uint8,
    at least the payload's size). Returns the token count; raises :class:`CorruptRecord` and
    leaves ``out`` untouched when the header or the stored bytes are wrong."""
    view = memoryview(buf).cast("B")
    header = decode_header(view, fingerprint, expected_key)
    if view.nbytes != header.record_len:
        raise CorruptRecord(f"record is {view.nbytes} bytes, header says {header.record_len}")
    stored = view[HEADER_SIZE:]
    verify_stored(header, stored, fingerprint.layout)
    _decode_into(header, stored, out, fingerprint.layout)
    return header.num_tokens
