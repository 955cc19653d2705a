"""The P2P wire: framed msgspec messages between two hosts' ``kvtier server``s (never pickle).

Frames are :mod:`kvtier.framing`'s, magic ``KVQ``. Every connection opens with kvtier's one
handshake (:mod:`kvtier.trust.handshake`, protocol ``p2p``, keyed by ``p2p_auth_token``;
each side's identity is its node name), then carries one kind of traffic::

    dialer (subscriber or puller)              listener (the peer's P2P port)
    ... kvtier.trust handshake ...        <->

    Subscribe()                           ->   what this peer's CPU tiers hold, and every
                                          <-  Holdings(fp, added, removed, reset)  change
                                          <-  Holdings("", [], [], False)  heartbeat, each
                                                  lease/3 s with nothing to say

    Fetch(fp, transfer id, keys)          ->   read each key from that model's CPU tier
                                          <-  Chunk(index, tokens, nbytes, checksum) + bytes
                                          <-  ... Missing(index): gone since announced, the
                                                  rest of the keys are not sent
                                          <-  Done(transfer id)
    Fetch(...)                            ->   the next pull on the same connection

A chunk's ``checksum`` is PD's (:func:`kvtier.pd.checksum.checksum`) over its payload; the
puller receives the payload straight into its own page and checks it there: a mismatch is
a miss. A transfer id is single use: the listener refuses one it has served. Every read and
write here takes a deadline for the whole message (:func:`kvtier.framing.read_message`), so
a peer's pace never stretches an operation past its own.
"""

from __future__ import annotations

import socket
from typing import TypeVar

import msgspec

from kvtier.errors import ProtocolError
from kvtier.framing import Framing, read_message
from kvtier.framing import send as send_frame

MAGIC = b"KVQ"
VERSION = 2  # 2: the handshake is kvtier.trust's, before the first P2P frame
PROTOCOL = "p2p"  # the handshake's protocol label
MAX_BODY_BYTES = 4 << 20  # a Holdings of ~200k keys; senders split bigger ones
KEYS_PER_MESSAGE = 65536  # 16-byte keys: ~1.2 MiB of msgpack per Holdings or Fetch

T = TypeVar("T")


class Subscribe(msgspec.Struct, tag=True):
    pass


class Holdings(msgspec.Struct, tag=True):
    fingerprint: str  # hex; "" for a heartbeat
    added: list[bytes]
    removed: list[bytes]
    reset: bool = False  # forget what this peer said of this fingerprint before


class Fetch(msgspec.Struct, tag=True):
    fingerprint: str
    transfer_id: str
    keys: list[bytes]


class Chunk(msgspec.Struct, tag=True):
    index: int
    num_tokens: int
    nbytes: int  # the payload follows the frame, then nothing else
    checksum: int


class Missing(msgspec.Struct, tag=True):
    index: int
    why: str


class Done(msgspec.Struct, tag=True):
    transfer_id: str


Message = Subscribe | Holdings | Fetch | Chunk | Missing | Done

FRAMING: Framing[Message] = Framing(MAGIC, VERSION, MAX_BODY_BYTES, Message)


def send(sock: socket.socket, message: Message, deadline: float) -> None:
    """Send ``message`` whole by ``deadline`` (monotonic), or :class:`TransferTimeout`."""
    send_frame(sock, FRAMING.encode(message), deadline)


def recv(sock: socket.socket, deadline: float | None) -> Message | None:
    """The next message, whole by ``deadline`` (None: the socket's own timeout bounds each
    wait), or None when the peer closed the connection between frames."""
    return read_message(sock, FRAMING, deadline)


def expect(sock: socket.socket, kind: type[T], deadline: float, where: str) -> T:
    """The next message, which must be a ``kind``."""
    msg = recv(sock, deadline)
    if not isinstance(msg, kind):
        got = "end of stream" if msg is None else type(msg).__name__
        raise ProtocolError(f"{where}: expected {kind.__name__}, got {got}")
    return msg
