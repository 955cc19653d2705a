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

import contextlib
import socket
import time
from typing import Any

import msgspec

from kvtier.errors import ProtocolError, TransferError, TransferTimeout
from kvtier.framing import HEADER, Framing
from kvtier.keys import RequestSalt

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


class Hit(msgspec.Struct, tag=True):
    tokens: int
    cpu_tokens: int = 0  # of which in the CPU tier (load at once; the rest reads a lower tier)


class Pages(msgspec.Struct, tag=True):
    end: int  # Retrieve: end of the loaded prefix
    pages: list[int]
    starts: list[int]  # first token of each page's chunk
    counts: list[int]  # tokens in each page


class Stored(msgspec.Struct, tag=True):
    chunks: int


class Ended(msgspec.Struct, tag=True):
    ok: bool


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
parse_header = FRAMING.parse_header
decode_body = FRAMING.decode_body


class FrameReader:
    """Reads whole frames from a blocking socket, keeping any bytes past the current frame.

    Deadlines are for whole frames, never per ``recv`` (a peer that trickles one byte at a
    time must not hold a connection open forever)::

        read(deadline)   the whole message must have arrived by ``deadline`` (monotonic)
        read()           waiting for a frame to begin: the socket's idle timeout (None on
                         the server after the Hello: a client may idle between requests);
                         once its first byte came, the frame must be whole within
                         ``stall_timeout`` (:data:`STALL_TIMEOUT_S`) of that byte

    Missing a deadline raises :class:`ProtocolError` (the frame counts as truncated).
    """

    def __init__(self, sock: socket.socket, stall_timeout: float | None = None) -> None:
        self.sock = sock
        self._stall_timeout = stall_timeout
        self._buf = bytearray()
        self._idle_timeout = sock.gettimeout()
        self._seen = False

    @property
    def stall_timeout(self) -> float:
        """Seconds a frame may take from its first byte to its last."""
        return STALL_TIMEOUT_S if self._stall_timeout is None else self._stall_timeout

    @property
    def started(self) -> bool:
        """Whether any byte has arrived on this connection yet."""
        return self._seen

    def set_idle_timeout(self, timeout: float | None) -> None:
        """How long to wait for a frame to begin (None: forever)."""
        self._idle_timeout = timeout
        self.sock.settimeout(timeout)

    def feed(self, data: bytes) -> None:
        """Bytes already taken off the socket (e.g. by ``recv_fds``) that belong to frames."""
        self._buf += data

    def read(self, deadline: float | None = None) -> Message | None:
        """The next message, or None when the peer closed the connection between frames.
        ``deadline``: see the class docstring."""
        frame = _Deadline(deadline, self.stall_timeout)
        try:
            if self._buf:
                frame.begin()
            while len(self._buf) < HEADER.size:
                if not self._recv(frame):
                    if not self._buf:
                        return None
                    raise ProtocolError(
                        f"truncated frame header ({len(self._buf)} bytes, then EOF)"
                    )
            length = parse_header(memoryview(self._buf)[: HEADER.size])
            end = HEADER.size + length
            while len(self._buf) < end:
                if not self._recv(frame):
                    got = len(self._buf) - HEADER.size
                    raise ProtocolError(f"truncated frame body ({got} of {length} bytes, then EOF)")
        finally:
            self.sock.settimeout(self._idle_timeout)
        body = bytes(memoryview(self._buf)[HEADER.size : end])
        del self._buf[:end]
        return decode_body(body)

    def _recv(self, frame: _Deadline) -> bool:
        sock = self.sock
        try:
            sock.settimeout(frame.left(self._idle_timeout))
            data = sock.recv(1 << 16)
        except TimeoutError:
            raise ProtocolError(frame.missed()) from None
        except OSError as exc:
            raise TransferError(f"connection lost while receiving: {exc}") from None
        if data:
            self._buf += data
            self._seen = True
            frame.begin()
        return bool(data)


class _Deadline:
    """When the frame being read must be whole: the caller's deadline, and ``stall`` seconds
    after its first byte, whichever comes first."""

    def __init__(self, deadline: float | None, stall: float) -> None:
        self.deadline = deadline
        self.stall = stall
        self.at = deadline
        self.begun = False

    def begin(self) -> None:
        if not self.begun:
            self.begun = True
            stalled = time.monotonic() + self.stall
            self.at = stalled if self.at is None else min(self.at, stalled)

    def left(self, idle: float | None) -> float | None:
        """The timeout for the next ``recv``; ``idle`` until the frame begins (no deadline)."""
        if self.at is None:
            return idle
        left = self.at - time.monotonic()
        if left <= 0:
            raise ProtocolError(self.missed())
        return left

    def missed(self) -> str:
        if self.at is not None and self.at == self.deadline:
            return "message not whole by its deadline"
        if self.begun:
            return f"frame stalled: not whole within {self.stall:g} s of its first byte"
        return "no frame within the idle timeout"


def send(sock: socket.socket, message: Message, deadline: float | None = None) -> None:
    """Send ``message`` whole; with ``deadline`` (monotonic), by then or
    :class:`TransferTimeout` (a peer that does not read its replies cannot hold a thread)."""
    data = encode(message)
    before = sock.gettimeout()
    try:
        if deadline is not None:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
        sock.sendall(data)
    except TimeoutError:
        raise TransferTimeout("peer did not accept a message in time") from None
    except OSError as exc:
        raise TransferError(f"connection lost while sending: {exc}") from None
    finally:
        if deadline is not None:
            with contextlib.suppress(OSError):
                sock.settimeout(before)
