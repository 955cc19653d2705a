"""Length-prefixed msgpack frames, the wire of kvtier's two socket protocols (PD, server).

::

    +--------+---------+-------------+-----------------------------+
    | magic  | version | body length | body: one msgpack message   |
    | 3 B    | 1 B     | 4 B (BE)    | <= max_body bytes           |
    +--------+---------+-------------+-----------------------------+

Every check that makes a frame safe to read (magic, version, the bound on the body, a body
that decodes to one of the protocol's messages) raises :class:`ProtocolError`, so a peer
that speaks something else is refused before anything is allocated for it.
"""

from __future__ import annotations

import struct
from typing import Generic, TypeVar

import msgspec

from kvtier.errors import ProtocolError

M = TypeVar("M")

HEADER = struct.Struct("!3sBI")


class Framing(Generic[M]):
    """The frame format of one protocol: its magic, version, body bound and message type."""

    def __init__(self, magic: bytes, version: int, max_body: int, message_type: object) -> None:
        self.magic = magic
        self.version = version
        self.max_body = max_body
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder: msgspec.msgpack.Decoder[M] = msgspec.msgpack.Decoder(message_type)

    def encode(self, message: M) -> bytes:
        body = self._encoder.encode(message)
        if len(body) > self.max_body:
            raise ProtocolError(
                f"{type(message).__name__} is {len(body)} bytes; the limit is {self.max_body}"
            )
        return HEADER.pack(self.magic, self.version, len(body)) + body

    def parse_header(self, header: bytes | bytearray | memoryview) -> int:
        """The body length a frame header announces, after checking magic, version, bound."""
        magic, version, length = HEADER.unpack(header)
        if magic != self.magic:
            raise ProtocolError(f"bad frame magic {magic!r} (expected {self.magic!r})")
        if version != self.version:
            raise ProtocolError(f"protocol version {version} is not this side's {self.version}")
        if length > self.max_body:
            raise ProtocolError(f"frame of {length} bytes exceeds the {self.max_body}-byte limit")
        return int(length)

    def decode_body(self, body: bytes | bytearray | memoryview) -> M:
        try:
            return self._decoder.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProtocolError(f"malformed message: {exc}") from None
