"""The lookup channel: how vLLM's scheduler process reaches the cache in the worker process.

The worker owns the cache (see the package docstring for why); the scheduler needs two things
from it between steps, and they cannot wait for the next step's metadata::

    scheduler (engine-core process)                   worker process
    LookupClient.lookup(rid, tokens, salt) ── Unix socket ──▶ pins the hit in rid's lease
                                           ◀── Hit(tokens, cpu_tokens)
    LookupClient.end(rid)                  ── Unix socket ──▶ ends rid's lease (also while idle)
                                           ◀── Ended(ok)

Tests, the benchmark and operators use the same socket for ``stats``, ``leaks``, ``check``
(``check_invariants``), ``flush`` and ``clear``.

Wire: :mod:`kvtier.framing` frames (magic ``KVL``), typed msgspec messages, never pickle. One
connection, one request at a time, each answered by exactly one reply::

    Hello(version, engine_id)          ->  <- Welcome(pid) | Refused(reason), then closes
    Lookup(request_id, tokens, salt)   ->  <- Hit(tokens, cpu_tokens)
    End(request_id)                    ->  <- Ended(ok)
    GetStats / GetLeaks / Check        ->  <- Stats / Leaks / Problems
    Flush(timeout) / Clear             ->  <- Ended(ok) / Cleared(dropped)
    a request the worker cannot serve  ->  <- Failed(kind, message); the connection stays

Who may talk to whom (see :mod:`kvtier.local_sockets` and docs/security.md): the socket sits in
a directory this user owns and nobody else can write (0700; one made by another user, or
writable by others, is refused), the file is 0600, and both ends check the other's uid with
``SO_PEERCRED``: the worker serves only its own uid, the scheduler trusts only a worker of
its own uid. Same-uid processes are trusted (they can read our memory anyway).

Deadlines: every connect, handshake and call has one (the client's ``timeout``, 5 s for a
lookup by default, or the ``timeout=`` of one call), including the wait for the client's own
lock, so a worker that is paused, dead or wedged makes a call fail in bounded time and an
``end`` is never stuck behind a hung lookup. The worker accepts on one thread and serves
each connection on its own: a peer that connects and stays silent holds one of
:data:`MAX_CONNECTIONS` slots until its Hello deadline, and never delays anyone else's accept.
Every failure reaches the caller as a :class:`~kvtier.errors.TransferError` (its
:class:`~kvtier.errors.TransferTimeout`, :class:`~kvtier.errors.AuthError` or
:class:`~kvtier.errors.ProtocolError`); the scheduler turns it into a miss.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

import msgspec

from kvtier import local_sockets
from kvtier.errors import (
    InputError,
    KVTierError,
    ProtocolError,
    StateError,
    TransferError,
    TransferTimeout,
)
from kvtier.framing import HEADER, Framing
from kvtier.keys import RequestSalt
from kvtier.repeated_log import RepeatedLog

log = logging.getLogger(__name__)

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


class Hit(msgspec.Struct, tag=True):
    tokens: int  # the hit, pinned for the request
    cpu_tokens: int  # of which in the CPU tier (loadable within the step)


class Ended(msgspec.Struct, tag=True):
    ok: bool


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


Request = Hello | Lookup | End | GetStats | GetLeaks | Check | Flush | Clear
Reply = Welcome | Refused | Hit | Ended | Stats | Leaks | Problems | Cleared | Failed
Message = Request | Reply

FRAMING: Framing[Message] = Framing(MAGIC, VERSION, MAX_BODY_BYTES, Message)
R = TypeVar("R", bound=Reply)


class LookupHandler(Protocol):
    """What the worker serves on its channel (the worker side implements it)."""

    def lookup(self, request_id: str, tokens: list[int], cache_salt: RequestSalt | None) -> Hit: ...
    def end(self, request_id: str) -> bool: ...
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


# -- the worker's end -----------------------------------------------------------------------
class LookupServer:
    """Serves ``handler`` on the worker's socket until :meth:`close`."""

    def __init__(
        self, engine_id: str, rank: int, handler: LookupHandler, *, directory: str | None = None
    ) -> None:
        self.engine_id = engine_id
        self.path = socket_path(engine_id, rank, directory)
        self._chosen = directory is not None
        self._handler = handler
        self._listener: socket.socket | None = None
        self._closed = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._complaints = RepeatedLog(log)
        self.refused = 0

    def open(self) -> LookupServer:
        """Listen. :class:`StateError` when the directory is not private to this user, or
        the path holds something that is not a stale socket of ours."""
        if self._chosen:
            local_sockets.private_directory(str(self.path.parent), closed=True)
        else:  # a directory another user took first is stepped around, not fatal
            default = local_sockets.default_directory(CHANNEL_DIRECTORY)
            self.path = Path(local_sockets.claim_directory(default)) / self.path.name
        self._listener = local_sockets.bind(str(self.path), backlog=64)
        self._listener.settimeout(0.2)  # how soon the accept loop notices close()
        threading.Thread(target=self._accept, name="kvtier-lookup-accept", daemon=True).start()
        return self

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()
        local_sockets.remove(str(self.path))

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if not self._closed.is_set():
                    self._complaints.warning("accept", "kvtier lookup channel: accept failed")
                    time.sleep(0.05)
                continue
            try:
                local_sockets.check_peer(conn, os.geteuid(), "a lookup channel client")
            except KVTierError as exc:
                self._refuse(conn, str(exc))
                continue
            with self._lock:
                full = len(self._conns) >= MAX_CONNECTIONS
                if not full:
                    self._conns.add(conn)
            if full:
                self._refuse(conn, f"{MAX_CONNECTIONS} connections already open")
                continue
            threading.Thread(
                target=self._serve, args=(conn,), name="kvtier-lookup", daemon=True
            ).start()

    def _refuse(self, conn: socket.socket, why: str) -> None:
        self.refused += 1
        self._complaints.warning("refused", "kvtier lookup channel: refused a client: %s", why)
        conn.close()

    def _serve(self, conn: socket.socket) -> None:
        reader = FrameReader(conn)
        try:
            first = reader.read(time.monotonic() + HELLO_TIMEOUT_S)
            if not isinstance(first, Hello):
                raise ProtocolError(f"expected Hello first, got {type(first).__name__}")
            refusal = self._check_hello(first)
            if refusal is not None:
                send(conn, Refused(refusal), time.monotonic() + 1.0)
                raise ProtocolError(refusal)
            send(conn, Welcome(os.getpid()), time.monotonic() + STALL_TIMEOUT_S)
            while not self._closed.is_set():
                message = reader.read(None)
                if message is None:
                    return
                send(conn, self._answer(message), time.monotonic() + STALL_TIMEOUT_S)
        except (ProtocolError, TransferTimeout) as exc:
            if not self._closed.is_set():
                self._complaints.warning(
                    "protocol", "kvtier lookup channel: closing a connection: %s", exc
                )
        except TransferError:
            pass  # the peer went away
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _check_hello(self, hello: Hello) -> str | None:
        if hello.version != VERSION:
            return f"client speaks lookup channel version {hello.version}, worker {VERSION}"
        if hello.engine_id != self.engine_id:
            return f"this worker serves engine {self.engine_id!r}, not {hello.engine_id!r}"
        return None

    def _answer(self, message: Message) -> Reply:
        try:
            return self._dispatch(message)
        except ProtocolError:
            raise
        except KVTierError as exc:
            return Failed(type(exc).__name__, str(exc))
        except Exception as exc:  # never let one bad call kill the channel
            log.exception("kvtier lookup channel: %s failed", type(message).__name__)
            return Failed(type(exc).__name__, str(exc))

    def _dispatch(self, message: Message) -> Reply:
        handler = self._handler
        match message:
            case Lookup(request_id=rid, tokens=tokens, cache_salt=salt):
                return handler.lookup(rid, tokens, salt)
            case End(request_id=rid):
                return Ended(handler.end(rid))
            case GetStats():
                return Stats(handler.stats())
            case GetLeaks():
                return Leaks(handler.leaks())
            case Check():
                return Problems(handler.check())
            case Flush(timeout=timeout):
                return Ended(handler.flush(_flush_timeout(timeout)))
            case Clear():
                return Cleared(handler.clear())
            case Hello():
                raise ProtocolError("a second Hello on one connection")
            case _:
                raise ProtocolError(f"{type(message).__name__} is a reply, not a request")


def _flush_timeout(timeout: float) -> float:
    if not math.isfinite(timeout) or timeout < 0:
        raise InputError(f"flush timeout must be a finite number of seconds >= 0, got {timeout}")
    return timeout


# -- the scheduler's end --------------------------------------------------------------------
class LookupClient:
    """The scheduler's (or a test's) end of one worker's socket. Thread-safe.

    Every method raises :class:`TransferError` (or a subclass) when the worker cannot be
    reached, is not who it should be, misbehaves or does not answer within ``timeout``;
    a worker's refusal of a well-formed call is a :class:`TransferError` naming its reason.
    ``peer_uid``: the uid the worker must run as (default: ours).
    """

    def __init__(
        self,
        engine_id: str,
        rank: int = 0,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        directory: str | None = None,
        peer_uid: int | None = None,
    ) -> None:
        self.engine_id = engine_id
        self.rank = rank
        self.path = socket_path(engine_id, rank, directory)
        self._chosen = directory is not None
        self.timeout = timeout
        self.peer_uid = os.geteuid() if peer_uid is None else peer_uid
        self._sock: socket.socket | None = None
        self._reader: FrameReader | None = None
        self._lock = threading.Lock()

    # -- typed calls -----------------------------------------------------------------------
    def lookup(
        self,
        request_id: str,
        tokens: list[int],
        cache_salt: RequestSalt | None = None,
        *,
        timeout: float | None = None,
    ) -> tuple[int, int]:
        """(hit, of which in the CPU tier), pinned in the worker until :meth:`end`."""
        try:
            message = Lookup(str(request_id), [int(t) for t in tokens], cache_salt)
        except (TypeError, ValueError) as exc:
            raise InputError(f"lookup of {request_id!r}: tokens must be integers ({exc})") from None
        reply = self._call(message, timeout)
        hit = _expect(reply, Hit)
        return hit.tokens, hit.cpu_tokens

    def end(self, request_id: str, *, timeout: float | None = None) -> bool:
        return _expect(self._call(End(request_id), timeout), Ended).ok

    def stats(self, *, timeout: float | None = None) -> dict[str, Any]:
        return _expect(self._call(GetStats(), timeout), Stats).stats

    def leaks(self, *, timeout: float | None = None) -> list[Leak]:
        return _expect(self._call(GetLeaks(), timeout), Leaks).leaks

    def check(self, *, timeout: float | None = None) -> list[str]:
        return _expect(self._call(Check(), timeout), Problems).problems

    def flush(self, flush_timeout: float, *, timeout: float | None = None) -> bool:
        return _expect(self._call(Flush(_flush_timeout(flush_timeout)), timeout), Ended).ok

    def clear(self, *, timeout: float | None = None) -> dict[str, int]:
        return _expect(self._call(Clear(), timeout), Cleared).dropped

    def call(self, op: str, *args: Any, timeout: float | None = None) -> Any:
        """The same calls by name (operators, tests): ``call("lookup", rid, tokens)``,
        ``call("flush", 60.0)``, ``call("stats")``..."""
        calls: dict[str, Callable[..., Any]] = {
            "lookup": self.lookup,
            "end": self.end,
            "stats": self.stats,
            "leaks": self.leaks,
            "check": self.check,
            "flush": self.flush,
            "clear": self.clear,
        }
        if op not in calls:
            raise InputError(
                f"unknown kvtier channel op {op!r}; use lookup, end, stats, leaks, check, "
                f"flush, clear"
            )
        return calls[op](*args, timeout=timeout)

    def close(self) -> None:
        if self._lock.acquire(timeout=self.timeout):
            try:
                self._drop()
            finally:
                self._lock.release()

    # -- the round trip --------------------------------------------------------------------
    def _call(self, request: Request, timeout: float | None) -> Message:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TransferTimeout(
                f"kvtier worker at {self.path}: another call held the channel past this "
                f"call's deadline"
            )
        try:
            try:
                self._connect(deadline)
                assert self._sock is not None and self._reader is not None
                send(self._sock, request, deadline)
                reply = self._reader.read(deadline)
                if reply is None:
                    raise TransferError("the worker closed the connection")
            except TransferError as exc:
                self._drop()  # a half-read reply would answer the next call
                if str(self.path) in str(exc):
                    raise
                raise type(exc)(f"kvtier worker at {self.path}: {exc}") from None
            except Exception as exc:  # e.g. a token msgpack cannot encode: still a failed call
                self._drop()
                raise TransferError(f"kvtier worker at {self.path}: {exc!r}") from None
        finally:
            self._lock.release()
        if isinstance(reply, Failed):
            raise TransferError(f"kvtier worker refused {type(request).__name__}: {reply.message}")
        return reply

    def _connect(self, deadline: float) -> None:
        # The worker opens its socket once vLLM registers the KV caches, which can be after
        # the scheduler starts asking: retry "nobody there" until the deadline.
        while self._sock is None:
            if not self._chosen:  # the worker may have stepped around a squatted directory
                self.path = socket_path(self.engine_id, self.rank)
            what = f"the kvtier worker at {self.path}"
            try:
                if os.path.lexists(self.path.parent):
                    local_sockets.private_directory(
                        str(self.path.parent), create=False, closed=True
                    )
                left = deadline - time.monotonic()
                sock = local_sockets.connect(str(self.path), max(left, 0.001), self.peer_uid, what)
            except StateError as exc:  # the directory is not private: trust nothing in it
                if self._chosen:
                    raise TransferError(str(exc)) from None
                self._wait_for_worker(deadline, str(exc))  # ours is not up beside it yet
                continue
            except TransferError as exc:
                if not isinstance(exc.__cause__, FileNotFoundError | ConnectionRefusedError):
                    raise
                self._wait_for_worker(deadline, f"no kvtier worker listening at {self.path}")
                continue
            reader = FrameReader(sock)
            try:
                send(sock, Hello(VERSION, self.engine_id), deadline)
                reply = reader.read(deadline)
                if isinstance(reply, Refused):
                    raise TransferError(f"{what} refused this client: {reply.reason}")
                if not isinstance(reply, Welcome):
                    got = type(reply).__name__ if reply is not None else "EOF"
                    raise ProtocolError(f"{what} answered Hello with {got}")
            except BaseException:
                sock.close()
                raise
            self._sock, self._reader = sock, reader

    def _wait_for_worker(self, deadline: float, why: str) -> None:
        if time.monotonic() >= deadline:
            raise TransferTimeout(why)
        time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    def _drop(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
        self._sock = self._reader = None


def _expect(reply: Message, kind: type[R]) -> R:
    if not isinstance(reply, kind):
        raise ProtocolError(f"expected {kind.__name__}, got {type(reply).__name__}")
    return reply


# -- frames with deadlines ------------------------------------------------------------------
class FrameReader:
    """Whole frames off a blocking socket. ``read(deadline)``: the whole frame by the
    deadline; ``read(None)``: waiting for a frame to begin has no limit, but once begun it
    must end within :data:`STALL_TIMEOUT_S`."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = bytearray()

    def read(self, deadline: float | None) -> Message | None:
        """The next message, or None when the peer closed between frames."""
        while len(self._buf) < HEADER.size:
            if not self._recv(deadline, begun=bool(self._buf)):
                if not self._buf:
                    return None
                raise ProtocolError(f"truncated frame header ({len(self._buf)} bytes, then EOF)")
        length = FRAMING.parse_header(memoryview(self._buf)[: HEADER.size])
        end = HEADER.size + length
        if deadline is None:
            deadline = time.monotonic() + STALL_TIMEOUT_S
        while len(self._buf) < end:
            if not self._recv(deadline, begun=True):
                got = len(self._buf) - HEADER.size
                raise ProtocolError(f"truncated frame body ({got} of {length} bytes, then EOF)")
        body = bytes(memoryview(self._buf)[HEADER.size : end])
        del self._buf[:end]
        return FRAMING.decode_body(body)

    def _recv(self, deadline: float | None, *, begun: bool) -> bool:
        if deadline is None and begun:
            deadline = time.monotonic() + STALL_TIMEOUT_S
        timeout = None if deadline is None else max(0.001, deadline - time.monotonic())
        try:
            self.sock.settimeout(timeout)
            data = self.sock.recv(1 << 16)
        except TimeoutError:
            raise TransferTimeout("the peer did not answer in time") from None
        except OSError as exc:
            raise TransferError(f"connection lost while receiving: {exc}") from None
        self._buf += data
        return bool(data)


def send(sock: socket.socket, message: Message, deadline: float) -> None:
    data = FRAMING.encode(message)
    try:
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        sock.sendall(data)
    except TimeoutError:
        raise TransferTimeout("the peer did not take the message in time") from None
    except OSError as exc:
        raise TransferError(f"connection lost while sending: {exc}") from None
