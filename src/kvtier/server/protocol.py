"""The kvtier server protocol: framed, versioned, size-bounded msgspec messages (never pickle).

A frame on the wire (a Unix stream socket)::

    +---------+---------+-------------+----------------------------+
    | "KVS"   | version | body length | body: msgpack of a message |
    | 3 bytes | 1 byte  | u32 (BE)    | <= MAX_BODY_BYTES          |
    +---------+---------+-------------+----------------------------+

Only control messages cross the socket; KV bytes never do. Each model (fingerprint) has a
page buffer in shared memory (a memfd), passed to the client once, with ``SCM_RIGHTS``, on
the Welcome frame; both sides map it. One connection, one request at a time, every request
answered by exactly one reply::

    client                                       server
    Hello(version, fingerprint, layout, ...) ->  checks version, peer uid, fingerprint; finds
                                                 or makes the model's engine
                                             <-  Welcome(num_pages, page_bytes) + memfd
                                                 | Refused(message), then closes
    Lookup(rid, tokens, skip, salt)          ->  pins the hit prefix in lease (conn, rid)
                                             <-  Hit(tokens, cpu_tokens)
    Retrieve(rid, tokens, skip, salt)        ->  makes the hit resident in pages of the lease
                                             <-  Pages(end, pages, starts, counts)
      client copies each page out of the shared buffer (the one copy)
    Reserve(store_id, tokens, skip, salt)    ->  a page per chunk not held, in lease (conn, #id)
                                             <-  Pages(0, pages, starts, counts)
      client copies its KV into each page (the one copy)
    Commit(store_id, ok)                     ->  publishes the pages (ok) or gives them back
                                             <-  Stored(chunks)
    EndRequest(rid)                          ->  <- Ended(ok)
    GetStats / CheckInvariants / Flush / RecordTTFT -> <- StatsReply / Problems / Flushed / Ended

A bad magic, an unknown version, a length above :data:`MAX_BODY_BYTES`, a truncated or
stalled frame, a body that is not one of these messages, or a message out of order raises
:class:`ProtocolError`; the server logs it, closes that connection and releases everything
the connection held. Other connections never notice.
"""

from __future__ import annotations

import socket
from typing import Any

import msgspec

from kvtier.framing import HEADER as HEADER  # tests build frames by hand
from kvtier.framing import FrameReader, Framing
from kvtier.hit import Hit as Hit  # the engine's answer, sent as it is
from kvtier.request_salt import RequestSalt

MAGIC = b"KVS"
VERSION = 1
MAX_BODY_BYTES = 4 << 20  # a 1M-token prompt as int32; anything bigger is abuse
STALL_TIMEOUT_S = 10.0  # a frame begun must be whole within this (between frames: no limit)


# -- client -> server -----------------------------------------------------------------------
class Hello(msgspec.Struct, tag=True):
    version: int
    fingerprint: str  # Fingerprint.hex() as the client computed it
    model_name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    chunk_size: int
    hash_algorithm: str
    tp_rank: int
    tp_world_size: int
    cache_salt: str
    save_unfull_chunk: bool
    planes: int = 2  # 1: an MLA latent (KVLayout.planes)
    groups: str = ""  # KVLayout.describe_groups(); "" for the one-group default


class Lookup(msgspec.Struct, tag=True):
    request_id: str
    tokens: bytes  # int32 little-endian
    skip: int = 0
    cache_salt: RequestSalt | None = None  # the request's own salt (vLLM's cache_salt): its keys
    checkpoints: int = 0  # a state model's checkpoint_tokens (kvtier.engine._checkpoints)


class Retrieve(msgspec.Struct, tag=True):
    request_id: str
    tokens: bytes
    skip: int = 0
    cache_salt: RequestSalt | None = None


class Reserve(msgspec.Struct, tag=True):
    store_id: int
    tokens: bytes
    skip: int = 0
    cache_salt: RequestSalt | None = None


class Commit(msgspec.Struct, tag=True):
    store_id: int
    ok: bool = True  # False: the client could not fill the pages; give them back unstored


class EndRequest(msgspec.Struct, tag=True):
    request_id: str


class GetStats(msgspec.Struct, tag=True):
    pass


class CheckInvariants(msgspec.Struct, tag=True):
    pass


class Flush(msgspec.Struct, tag=True):
    timeout: float | None = None


class RecordTTFT(msgspec.Struct, tag=True):
    seconds: float
    prompt_tokens: int
    hit_tokens: int


# -- server -> client -----------------------------------------------------------------------
class Welcome(msgspec.Struct, tag=True):
    num_pages: int
    page_bytes: int
    server_pid: int


class Refused(msgspec.Struct, tag=True):
    message: str


class Pages(msgspec.Struct, tag=True):
    end: int  # Retrieve: end of the loaded prefix
    pages: list[int]
    starts: list[int]  # first token of each page's chunk
    counts: list[int]  # tokens in each page


class Stored(msgspec.Struct, tag=True):
    chunks: int


class Ended(msgspec.Struct, tag=True):
    ok: bool
    # EndRequest's answer: the request's line (kvtier.observability.logs), for the client's
    # log: a vLLM worker on a server logs it as an in-process one does. None: nothing noted.
    line: str | None = None


class StatsReply(msgspec.Struct, tag=True):
    stats: dict[str, Any]


class Problems(msgspec.Struct, tag=True):
    problems: list[str]


class Failed(msgspec.Struct, tag=True):
    """A well-formed request the server could not serve; the connection stays open."""

    kind: str  # "input" (the caller's arguments), "state", "tier", "capacity" (a bound)
    message: str


Request = (
    Hello
    | Lookup
    | Retrieve
    | Reserve
    | Commit
    | EndRequest
    | GetStats
    | CheckInvariants
    | Flush
    | RecordTTFT
)
Reply = Welcome | Refused | Hit | Pages | Stored | Ended | StatsReply | Problems | Failed
Message = Request | Reply

FRAMING: Framing[Message] = Framing(MAGIC, VERSION, MAX_BODY_BYTES, Message)
encode = FRAMING.encode
send = FRAMING.send


def reader(sock: socket.socket, stall_timeout: float | None = None) -> FrameReader[Message]:
    """A reader of this protocol's frames (:class:`~kvtier.framing.FrameReader`: deadlines
    for whole frames); a frame begun must be whole within :data:`STALL_TIMEOUT_S`, read at
    the call, unless ``stall_timeout`` says otherwise."""
    return FrameReader(sock, FRAMING, STALL_TIMEOUT_S if stall_timeout is None else stall_timeout)
