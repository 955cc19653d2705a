"""The lookup channel's wire: its messages, their framing, and where the socket is.

See the package docstring for the conversation; :mod:`kvtier.framing` for the frames.
"""

from __future__ import annotations

import hashlib
import math
import socket
from pathlib import Path
from typing import Any, Protocol

import msgspec

from kvtier import local_sockets
from kvtier.errors import InputError
from kvtier.framing import HEADER as HEADER  # tests build frames by hand
from kvtier.framing import FrameReader, Framing
from kvtier.hit import Hit as Hit  # the worker's cache's answer, sent as it is
from kvtier.request_salt import RequestSalt

MAGIC = b"KVL"
VERSION = 1
MAX_BODY_BYTES = 16 << 20  # a 1M-token prompt as msgpack ints is ~5 MB
HELLO_TIMEOUT_S = 5.0  # a peer that connects must say Hello within this
STALL_TIMEOUT_S = 10.0  # a frame begun must end within this (between frames: no limit)
MAX_CONNECTIONS = 32  # one scheduler per TP rank plus probes; more is someone misbehaving
DEFAULT_TIMEOUT_S = 5.0  # a lookup is a hash and a pin: far below this on a live worker


# -- scheduler -> worker --------------------------------------------------------------------
class Hello(msgspec.Struct, tag=True):
    version: int
    engine_id: str


class Lookup(msgspec.Struct, tag=True):
    request_id: str
    tokens: list[int]
    cache_salt: RequestSalt | None = None


class End(msgspec.Struct, tag=True):
    request_id: str


class PullFrom(msgspec.Struct, tag=True):
    """PD decoder (xPyD): pull transfer ``request_id`` from the prefiller at ``host:port``
    (started by the first call, polled by the next ones)."""

    request_id: str  # the transfer id
    tokens: list[int]
    cache_salt: RequestSalt | None
    host: str
    port: int


class GetStats(msgspec.Struct, tag=True):
    pass


class GetLeaks(msgspec.Struct, tag=True):
    pass


class Check(msgspec.Struct, tag=True):
    pass


class Flush(msgspec.Struct, tag=True):
    timeout: float


class Clear(msgspec.Struct, tag=True):
    pass


# -- worker -> scheduler --------------------------------------------------------------------
class Welcome(msgspec.Struct, tag=True):
    pid: int


class Refused(msgspec.Struct, tag=True):
    reason: str


class Ended(msgspec.Struct, tag=True):
    ok: bool


class Pulling(msgspec.Struct, tag=True):
    done: bool  # the pull has ended (received, or failed: the decoder prefills)


class Stats(msgspec.Struct, tag=True):
    stats: dict[str, Any]


class Leak(msgspec.Struct, tag=True):
    request_id: str
    pinned_pages: int
    holds: list[Any]


class Leaks(msgspec.Struct, tag=True):
    leaks: list[Leak]


class Problems(msgspec.Struct, tag=True):
    problems: list[str]


class Cleared(msgspec.Struct, tag=True):
    dropped: dict[str, int]


class Failed(msgspec.Struct, tag=True):
    """A well-formed request the worker could not serve; the connection stays open."""

    kind: str  # the kvtier error's class name
    message: str


Request = Hello | Lookup | End | PullFrom | GetStats | GetLeaks | Check | Flush | Clear
Reply = Welcome | Refused | Hit | Ended | Pulling | Stats | Leaks | Problems | Cleared | Failed
Message = Request | Reply

FRAMING: Framing[Message] = Framing(MAGIC, VERSION, MAX_BODY_BYTES, Message, STALL_TIMEOUT_S)
send = FRAMING.send


def reader(sock: socket.socket) -> FrameReader[Message]:
    """A reader of the channel's frames (:class:`~kvtier.framing.FrameReader`)."""
    return FRAMING.reader(sock)


class LookupHandler(Protocol):
    """What the worker serves on its channel (the worker side implements it)."""

    def lookup(self, request_id: str, tokens: list[int], cache_salt: RequestSalt | None) -> Hit: ...
    def end(self, request_id: str) -> bool: ...
    def pull(self, pull: PullFrom) -> bool: ...
    def stats(self) -> dict[str, Any]: ...
    def leaks(self) -> list[Leak]: ...
    def check(self) -> list[str]: ...
    def flush(self, timeout: float) -> bool: ...
    def clear(self) -> dict[str, int]: ...


CHANNEL_DIRECTORY = "kvtier-vllm"


def socket_path(engine_id: str, rank: int = 0, directory: str | None = None) -> Path:
    """Where the worker of tensor-parallel ``rank`` of vLLM instance ``engine_id`` listens:
    ``<directory>/<sha256(engine_id)[:16]>-r<rank>.sock``. Without ``directory``: in
    ``$XDG_RUNTIME_DIR/kvtier-vllm``, else ``$TMPDIR/kvtier-vllm-<uid>``, or in kvtier's own
    private directory beside it when another user took that name (see
    :mod:`kvtier.local_sockets`): where such a worker listens now, if it does."""
    digest = hashlib.sha256(engine_id.encode()).hexdigest()[:16]
    name = f"{digest}-r{rank}.sock"
    if directory is not None:
        return Path(directory) / name
    return Path(local_sockets.locate(local_sockets.default_directory(CHANNEL_DIRECTORY), name))


def check_flush_timeout(timeout: float) -> float:
    if not math.isfinite(timeout) or timeout < 0:
        raise InputError(f"flush timeout must be a finite number of seconds >= 0, got {timeout}")
    return timeout
