"""The identity codec (id 0): the stored bytes are the payload itself.

Encoding returns a view of the page (nothing is copied on the way to a file or a socket), and
the readers of :mod:`kvtier.storage.disk` and :mod:`kvtier.storage.redis` see ``is_identity``
and read the stored bytes straight into the page, so :meth:`IdentityCodec.decode` runs only
for a record already held in memory (a whole redis value), where it is the one copy.
"""

from __future__ import annotations

from kvtier.errors import CorruptRecord
from kvtier.layout import KVLayout
from kvtier.storage.codecs.base import PayloadCodec


class IdentityCodec(PayloadCodec):
    codec_id = 0
    name = "identity"
    is_identity = True

    def encode(self, payload: memoryview, layout: KVLayout) -> memoryview:
        return payload

    def decode(self, stored: memoryview, out: memoryview, layout: KVLayout) -> int:
        if stored.nbytes != out.nbytes:
            raise CorruptRecord(f"identity payload of {stored.nbytes} bytes, expected {out.nbytes}")
        out[:] = stored
        return stored.nbytes


IDENTITY = IdentityCodec()
