"""The payload codec interface: how a record's payload is turned into the bytes it stores.

Who calls what (:mod:`kvtier.storage.records` is the only caller)::

    writer   stored = codec.encode(payload, layout)         page bytes -> stored bytes
             header  = codec id, stored length, xxh3-128 of the *stored* bytes, ...
    reader   header checked, codec looked up by id           unknown id: a miss
             stored bytes read (identity: into the page itself; else a scratch buffer)
             checksum of the stored bytes compared           mismatch: a miss, never decoded
             n = codec.decode(stored, out, layout)           stored bytes -> page bytes
             n == payload length (layout.payload_bytes)      else: a miss

Ownership: ``encode`` only reads ``payload`` (a view of the caller's page, valid for the
call); what it returns is owned by the record writer until the write ends, and may be a view
of ``payload`` itself (the identity codec: no copy). ``decode`` writes only into ``out``,
which is exactly the payload's size, and keeps no reference to either buffer.

A codec's id is part of the record format (a u16 in the header, see the byte table in
:mod:`kvtier.storage.records`): once records with an id exist, the id means that codec for
good. 0 is the identity codec. The checksum covers the stored bytes, so a corrupt byte is
caught before a codec sees it; ``decode`` may still meet bytes it cannot decode (a stored
stream written by a broken encoder) and then raises :class:`~kvtier.errors.CorruptRecord`,
translating its own library's errors (``zlib.error``, ...) at this boundary.

``layout`` is passed so a codec that works on elements (fp8 or int8 quantisation of a bf16
page) knows their dtype and the page's parts; a byte codec ignores it. Every codec passes
the contract suite in ``tests/storage/codec_contract.py``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from kvtier.layout import KVLayout

Buffer = bytes | bytearray | memoryview

CODEC_ID_MAX = 0xFFFF  # the header holds a u16


class PayloadCodec(ABC):
    """Turns a record's payload into its stored bytes and back. Stateless and thread-safe:
    one instance serves every writer and reader thread of every tier."""

    codec_id: int  # u16, part of the format: never reuse one for another encoding
    name: str  # what a config or a log names it by
    is_identity: bool = False  # stored bytes are the payload: readers read into the page
    lossless: bool = True  # decode(encode(p)) == p byte for byte (fp8 / int8 will say False)

    @abstractmethod
    def encode(self, payload: memoryview, layout: KVLayout) -> Buffer:
        """The stored bytes for ``payload`` (flat bytes of one chunk, from its page)."""

    @abstractmethod
    def decode(self, stored: memoryview, out: memoryview, layout: KVLayout) -> int:
        """Decode ``stored`` into ``out`` (flat bytes, exactly the payload's size); return
        how many bytes of ``out`` were written. Raises CorruptRecord on bytes it cannot
        decode."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} id={self.codec_id}>"
