"""The PD control protocol: framed, versioned, size-bounded msgspec messages (never pickle).

A frame on the wire::

    +---------+---------+-------------+----------------------------+
    | "KVP"   | version | body length | body: msgpack of a message |
    | 3 bytes | 1 byte  | u32 (BE)    | <= MAX_BODY_BYTES          |
    +---------+---------+-------------+----------------------------+

A bad magic, an unknown version, a length above :data:`MAX_BODY_BYTES`, a truncated frame
or a body that is not one of the messages below raises :class:`ProtocolError`; the receiver
then closes that connection (and releases what it reserved for it) and keeps serving others.

One connection carries one sender's requests, one at a time. It opens with kvtier's one
handshake (:mod:`kvtier.trust.handshake`, protocol ``pd-push``: the sender dials), which
proves ``pd_auth_token`` both ways where one is set, before any PD frame moves::

    sender (dialer)                          receiver (listener)
    ... kvtier.trust handshake ...      <->
    Hello(fingerprint, page_bytes, ...) ->
                                         <-  HelloReply(num_pages, page_bytes, how to reach
                                                 the buffer: shm segment name / nixl metadata)
    AllocRequest(rid, keys, num_tokens, ->   reserve every missing chunk at once, or wait
                 tenant)                     (for room, and for room in the tenant's share)
                                         <-  AllocReply(held, pages) | ErrorReply(kind)
    ChunkSent(rid, index, nbytes, csum) ->   tcp: the next nbytes on the socket are the chunk,
      [tcp: payload, then its csum as        received straight into its page; shm: already
       8 big-endian bytes]                   written into the page. Verified, then published.
    ... one ChunkSent per chunk not held ...
    RequestDone(rid)                    ->
                                         <-  DoneReply(rid, ok, message)
    Abort(rid, reason)                  ->   (instead of the rest) the reservation is released

Pulled (xPyD, :mod:`kvtier.pd.source`): the decoder dials the prefiller named in the request's
``kv_transfer_params``; the handshake's protocol is ``pd-pull`` (so no proof from one kind of
PD port passes on the other), then the prefiller speaks first (Hello) and the rest is the
same conversation, each request opened by the decoder's claim::

    prefiller (listener)                     decoder (dialer)
    ... kvtier.trust handshake ...      <->
    Hello(...)                          ->
                                        <-  HelloReply
                                        <-  Pull(transfer id, the decoder's chunk keys)
    AllocRequest(transfer id, ...)      ->   (the held chunks: a prefix of the decoder's keys)
    ... as above ... | ErrorReply(kind: unknown / claimed / mismatch)

The receiver bounds each peer in time: the handshake and every message of a request (a
chunk's payload included) must arrive within ``pd_message_timeout_sec``, and a connection
idle between requests is closed after ``pd_idle_timeout_sec``.
"""

from __future__ import annotations

import socket

import msgspec

from kvtier.errors import TransferError, TransferTimeout
from kvtier.framing import HEADER as HEADER
from kvtier.framing import Framing, read_message
from kvtier.framing import recv_exact as recv_exact  # the transports read payloads with it

MAGIC = b"KVP"
# 2: the chunk checksum is per block (kvtier.pd.checksum); 3: Pull (xPyD); 4: the handshake
# is kvtier.trust's, before the first PD frame
VERSION = 4
PUSH = "pd-push"  # the handshake's protocol on a receiver's port (a sender dials)
PULL = "pd-pull"  # ... on a source's port (a decoder dials): no proof passes on the other
MAX_BODY_BYTES = 1 << 20  # 1 MiB: an AllocRequest for ~30k chunks; anything bigger is abuse


class Hello(msgspec.Struct, tag=True):
    fingerprint: str
    page_bytes: int
    token_bytes: int
    channel: str
    nixl_metadata: bytes = b""  # nixl: the sender's agent metadata


class HelloReply(msgspec.Struct, tag=True):
    num_pages: int
    page_bytes: int
    # shm: the segment's name, which the sender resolves in its own /dev/shm (never a path:
    # a peer that could name one could make the sender write into any file it can open)
    shm_segment: str = ""
    nixl_metadata: bytes = b""  # nixl: the receiver's agent metadata
    base_address: int = 0  # nixl: address of page 0 in the receiver's registered buffer


class AllocRequest(msgspec.Struct, tag=True):
    request_id: str
    keys: list[bytes]
    num_tokens: list[int]
    # The request's tenant under tenant_quotas: its cache_salt ("" none), whose share of the
    # receive buffer the reservation counts against (kvtier.pd.tenant_shares). On the
    # authenticated connection like the rest; a pulling decoder uses its own request's.
    tenant: str = ""


class AllocReply(msgspec.Struct, tag=True):
    request_id: str
    held: list[int]  # positions in keys the receiver already holds: not sent again
    pages: list[int]  # one page per position not held, in order


class ErrorReply(msgspec.Struct, tag=True):
    request_id: str
    kind: str  # "timeout", "too_large", "over_share", "rejected", "unknown", "claimed", ...
    message: str


class ChunkSent(msgspec.Struct, tag=True):
    request_id: str
    index: int  # position in the AllocRequest's keys
    nbytes: int
    checksum: int  # the payload's checksum (kvtier.pd.checksum)


class RequestDone(msgspec.Struct, tag=True):
    request_id: str


class DoneReply(msgspec.Struct, tag=True):
    request_id: str
    ok: bool
    message: str = ""


class Abort(msgspec.Struct, tag=True):
    request_id: str
    reason: str


class Pull(msgspec.Struct, tag=True):
    """A decoder's claim of a transfer: its id and the chunk keys of the decoder's prompt."""

    request_id: str  # the transfer id
    keys: list[bytes]


Message = (
    Hello
    | HelloReply
    | AllocRequest
    | AllocReply
    | ErrorReply
    | ChunkSent
    | RequestDone
    | DoneReply
    | Abort
    | Pull
)

FRAMING: Framing[Message] = Framing(MAGIC, VERSION, MAX_BODY_BYTES, Message)
encode = FRAMING.encode
parse_header = FRAMING.parse_header
decode_body = FRAMING.decode_body


def send_message(sock: socket.socket, message: Message) -> None:
    try:
        sock.sendall(encode(message))
    except TimeoutError:
        raise TransferTimeout("peer did not accept a control message in time") from None
    except OSError as exc:
        raise TransferError(f"connection lost while sending: {exc}") from None


def recv_message(sock: socket.socket, deadline: float | None = None) -> Message | None:
    """The next message, or None when the peer closed the connection between frames;
    ``deadline`` (monotonic): the whole frame by then (:func:`kvtier.framing.read_message`),
    else the socket's own timeout bounds each wait."""
    return read_message(sock, FRAMING, deadline)
