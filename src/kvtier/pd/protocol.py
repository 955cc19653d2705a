"""The PD control protocol: framed, versioned, size-bounded msgspec messages (never pickle).

A frame on the wire::

    +---------+---------+-------------+----------------------------+
    | "KVP"   | version | body length | body: msgpack of a message |
    | 3 bytes | 1 byte  | u32 (BE)    | <= MAX_BODY_BYTES          |
    +---------+---------+-------------+----------------------------+

A bad magic, an unknown version, a length above :data:`MAX_BODY_BYTES`, a truncated frame
or a body that is not one of the messages below raises :class:`ProtocolError`; the receiver
then closes that connection (and releases what it reserved for it) and keeps serving others.

One connection carries one sender's requests, one at a time::

    sender                                   receiver
    Hello(fingerprint, page_bytes, ...,  ->
          nonce)
                                         <-  Challenge(nonce, proof)     } only with a
    Proof(proof)                         ->                              } pd_auth_token:
                                         <-  ErrorReply("unauthorized")  } kvtier.pd.auth
                                                 when it fails
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
``kv_transfer_params``; the prefiller still speaks first (Hello) and the rest is the same
conversation, each request opened by the decoder's claim::

    prefiller (listens)                      decoder (dials)
    Hello(...)                          ->   ... handshake as above ...
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

from kvtier.errors import ProtocolError, TransferError, TransferTimeout
from kvtier.framing import HEADER, Framing

MAGIC = b"KVP"
VERSION = 3  # 2: the chunk checksum is per block (kvtier.pd.checksum); 3: Pull (xPyD)
MAX_BODY_BYTES = 1 << 20  # 1 MiB: an AllocRequest for ~30k chunks; anything bigger is abuse


class Hello(msgspec.Struct, tag=True):
    fingerprint: str
    page_bytes: int
    token_bytes: int
    channel: str
    nixl_metadata: bytes = b""  # nixl: the sender's agent metadata
    nonce: bytes = b""  # the sender's challenge (kvtier.pd.auth); empty without a token


class Challenge(msgspec.Struct, tag=True):
    nonce: bytes  # the receiver's challenge
    proof: bytes  # the receiver's answer to the sender's nonce


class Proof(msgspec.Struct, tag=True):
    proof: bytes  # the sender's answer to the receiver's nonce


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
    kind: str  # "timeout", "too_large", "over_share", "rejected", "unauthorized"
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
    | Challenge
    | Proof
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


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock`` (straight into it: no intermediate buffer)."""
    got, want = 0, len(view)
    try:
        while got < want:
            n = sock.recv_into(view[got:], want - got)
            if n == 0:
                raise TransferError(f"peer closed the connection ({got} of {want} bytes received)")
            got += n
    except TimeoutError:
        raise TransferTimeout(f"peer stalled ({got} of {want} bytes received)") from None
    except OSError as exc:
        raise TransferError(f"connection lost while receiving: {exc}") from None


def recv_message(sock: socket.socket) -> Message | None:
    """The next message, or None when the peer closed the connection between frames."""
    header = bytearray(HEADER.size)
    try:
        first = sock.recv_into(header, HEADER.size)
    except TimeoutError:
        raise TransferTimeout("peer sent nothing in time") from None
    except OSError as exc:
        raise TransferError(f"connection lost while receiving: {exc}") from None
    if first == 0:
        return None
    if first < HEADER.size:
        try:
            recv_exact(sock, memoryview(header)[first:])
        except TransferError as exc:
            raise ProtocolError(f"truncated frame header: {exc}") from None
    length = parse_header(bytes(header))
    body = bytearray(length)
    try:
        recv_exact(sock, memoryview(body))
    except TransferTimeout:
        raise
    except TransferError as exc:
        raise ProtocolError(f"truncated frame body: {exc}") from None
    return decode_body(bytes(body))
