"""Payload codecs under the record format, and the registry that finds them by id or name.

A record names its codec by id (:mod:`kvtier.storage.records`); a reader looks the id up
here, so a reader decodes every codec registered in its process, whatever codec its own
tier writes with. An id not registered here is a record this kvtier cannot read: a miss.

The registry holds the identity codec from the start; ``register`` adds one (a codec
package at import, a test for its duration), ``unregister`` takes it back. Ids and names
are unique; the identity codec cannot be replaced or removed.
"""

from __future__ import annotations

import threading

from kvtier.storage.codecs.base import CODEC_ID_MAX, Buffer, PayloadCodec
from kvtier.storage.codecs.identity import IDENTITY, IdentityCodec

__all__ = [
    "IDENTITY",
    "Buffer",
    "IdentityCodec",
    "PayloadCodec",
    "codec_by_id",
    "codec_by_name",
    "register",
    "registered",
    "unregister",
]

_lock = threading.Lock()
# Replaced, never changed in place: a reader looks ids up without the lock.
_by_id: dict[int, PayloadCodec] = {IDENTITY.codec_id: IDENTITY}


def register(codec: PayloadCodec) -> None:
    """Make ``codec`` readable (and usable by writers). Raises ValueError for an id outside
    the u16 range or an id or name already taken by another codec."""
    if not 0 <= codec.codec_id <= CODEC_ID_MAX:
        raise ValueError(f"codec id must be in 0..{CODEC_ID_MAX}, got {codec.codec_id}")
    global _by_id
    with _lock:
        for known in _by_id.values():
            if known is codec:
                return
            if known.codec_id == codec.codec_id or known.name == codec.name:
                raise ValueError(f"{codec!r} clashes with the registered {known!r}")
        _by_id = {**_by_id, codec.codec_id: codec}


def unregister(codec_id: int) -> None:
    """Forget a codec (records written with it become unreadable: misses)."""
    if codec_id == IDENTITY.codec_id:
        raise ValueError("the identity codec is part of the format and stays registered")
    global _by_id
    with _lock:
        _by_id = {i: c for i, c in _by_id.items() if i != codec_id}


def codec_by_id(codec_id: int) -> PayloadCodec | None:
    return _by_id.get(codec_id)


def codec_by_name(name: str) -> PayloadCodec | None:
    return next((c for c in _by_id.values() if c.name == name), None)


def registered() -> tuple[PayloadCodec, ...]:
    """Every registered codec, by id."""
    table = _by_id
    return tuple(table[i] for i in sorted(table))
