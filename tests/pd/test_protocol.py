"""Frames: round trips, and every way a frame can be bad raises ProtocolError."""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator

import pytest

from kvtier.errors import ProtocolError
from kvtier.pd.protocol import (
    HEADER,
    MAGIC,
    MAX_BODY_BYTES,
    VERSION,
    AllocRequest,
    ChunkSent,
    decode_body,
    encode,
    recv_message,
)


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    a.settimeout(5.0)
    b.settimeout(5.0)
    yield a, b
    a.close()
    b.close()


def test_messages_round_trip(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    msgs = [AllocRequest("r1", [b"k" * 16, b"j" * 16], [16, 3]), ChunkSent("r1", 1, 96, 2**63 + 5)]
    for msg in msgs:
        a.sendall(encode(msg))
    assert [recv_message(b), recv_message(b)] == msgs


def test_clean_close_between_frames_is_none(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    a.close()
    assert recv_message(b) is None


@pytest.mark.parametrize(
    "frame, match",
    [
        (b"GARBAGE!" + b"x" * 20, "magic"),
        (HEADER.pack(MAGIC, VERSION + 1, 2) + b"\x80\x80", "version"),
        (HEADER.pack(MAGIC, VERSION, MAX_BODY_BYTES + 1), "limit"),
        (HEADER.pack(MAGIC, VERSION, 5) + b"\xc1\xc1\xc1\xc1\xc1", "malformed"),
        (HEADER.pack(MAGIC, VERSION, 1) + b"\x80", "malformed"),  # an untagged empty map
    ],
)
def test_bad_frames_raise(
    pair: tuple[socket.socket, socket.socket], frame: bytes, match: str
) -> None:
    a, b = pair
    a.sendall(frame)
    with pytest.raises(ProtocolError, match=match):
        recv_message(b)


@pytest.mark.parametrize("cut", [2, HEADER.size, HEADER.size + 3])
def test_truncated_frames_raise(pair: tuple[socket.socket, socket.socket], cut: int) -> None:
    a, b = pair
    a.sendall(encode(AllocRequest("r1", [b"k" * 16], [16]))[:cut])
    a.close()
    with pytest.raises(ProtocolError, match="truncated"):
        recv_message(b)


def test_wrong_field_types_are_rejected() -> None:
    good = encode(ChunkSent("r", 0, 10, 1))[HEADER.size :]
    bad = good.replace(b"\xa1r", b"\x05")  # request_id becomes an int
    with pytest.raises(ProtocolError):
        decode_body(bad)


def test_an_oversized_message_is_refused_by_the_sender() -> None:
    huge = AllocRequest("r", [b"k" * 16] * (MAX_BODY_BYTES // 16), [1] * (MAX_BODY_BYTES // 16))
    with pytest.raises(ProtocolError, match="limit"):
        encode(huge)


def test_header_layout_is_fixed() -> None:
    assert HEADER.size == 8
    assert encode(ChunkSent("r", 0, 1, 1))[:4] == MAGIC + struct.pack("B", VERSION)
