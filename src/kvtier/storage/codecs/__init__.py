"""Payload codecs under the record format, and the registry that finds them by id or name.

A record names its codec by id (:mod:`kvtier.storage.records`); a reader looks the id up
here, so a reader decodes every codec registered in its process, whatever codec its own
tier writes with. An id not registered here is a record this kvtier cannot read: a miss.

The registry holds the identity codec from the start and kvtier's codecs from import;
``register`` adds one (a test for its duration), ``unregister`` takes it back. Ids and
names are unique; the identity codec cannot be replaced or removed. The ids are part of the
record format and fixed for good::

    id  name       lossless  module
    0   identity   yes       identity.py    the page itself, zero copy
    1   lossless   yes       lossless.py    byte shuffle + zstd-1 (blosc2)
    2   fp8        no        quantized.py   e4m3 + f32 scales per token and head
    3   int8       no        quantized.py   int8 + f32 scales (keys per channel)

A lossy codec must pass the quality gate for the KV dtype it stores (:mod:`.verdicts`): a
tier refuses at start one whose verdict failed. A tier writes with the codec its config
names (``cpu_codec``, ``disk_codec``, ``remote_codec``) and runs
under :func:`tier_fingerprint`: a lossy codec enters the fingerprint (the tier's namespace
and every record header), so a reader configured with another codec misses those chunks
instead of taking them as its own; a lossless one does not (any reader decodes it).
"""

from __future__ import annotations

import dataclasses
import threading

import torch

from kvtier.errors import ConfigError
from kvtier.fingerprint import Fingerprint
from kvtier.layout import dtype_name
from kvtier.storage.codecs import verdicts
from kvtier.storage.codecs.base import CODEC_ID_MAX, Buffer, PayloadCodec
from kvtier.storage.codecs.identity import IDENTITY, IdentityCodec
from kvtier.storage.codecs.lossless import LOSSLESS
from kvtier.storage.codecs.quantized import FP8, INT8, QuantizedCodec

__all__ = [
    "FP8",
    "IDENTITY",
    "INT8",
    "LOSSLESS",
    "Buffer",
    "IdentityCodec",
    "PayloadCodec",
    "QuantizedCodec",
    "codec_by_id",
    "codec_by_name",
    "codec_from_config",
    "register",
    "registered",
    "tier_fingerprint",
    "unregister",
]

BUILTIN: tuple[PayloadCodec, ...] = (IDENTITY, LOSSLESS, FP8, INT8)

_lock = threading.Lock()
# Replaced, never changed in place: a reader looks ids up without the lock.
_by_id: dict[int, PayloadCodec] = {c.codec_id: c for c in BUILTIN}


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


def codec_from_config(key: str, name: str, kv_dtype: torch.dtype | None = None) -> PayloadCodec:
    """The registered codec a config key names; ConfigError naming the choices if none.
    With ``kv_dtype`` (a tier at start: its layout's dtype), also ConfigError naming the
    measured loss for a lossy codec that failed the quality gate on that dtype
    (:func:`kvtier.storage.codecs.verdicts.check_codec`)."""
    codec = codec_by_name(name)
    if codec is None:
        choices = ", ".join(c.name for c in registered())
        raise ConfigError(key, name, f"one of {choices}")
    if kv_dtype is not None:
        verdicts.check_codec(key, codec, dtype_name(kv_dtype))
    return codec


def tier_fingerprint(fingerprint: Fingerprint, codec: PayloadCodec) -> Fingerprint:
    """The fingerprint a tier writing with ``codec`` runs under: ``fingerprint`` itself for a
    lossless codec, one naming the codec for a lossy one (module docstring)."""
    if codec.lossless:
        return fingerprint
    return dataclasses.replace(fingerprint, lossy_codec=codec.name)
