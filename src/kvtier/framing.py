"""Length-prefixed msgpack frames, the wire of kvtier's socket protocols (PD, the server, the
vLLM lookup channel), and the deadline reader and sender both local sockets use.

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

import contextlib
import socket
import struct
import time
from typing import Generic, TypeVar

import msgspec

from kvtier.errors import ProtocolError, TransferError, TransferTimeout

M = TypeVar("M")

HEADER = struct.Struct("!3sBI")


class Framing(Generic[M]):
    """The frame format of one protocol: its magic, version, body bound and message type."""

    def __init__(
        self,
        magic: bytes,
        version: int,
        max_body: int,
        message_type: object,
        stall_timeout: float = 10.0,
    ) -> None:
        self.magic = magic
        self.version = version
        self.max_body = max_body
        self.stall_timeout = stall_timeout  # a frame begun must be whole within this
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

    def reader(self, sock: socket.socket, stall_timeout: float | None = None) -> FrameReader[M]:
        """A :class:`FrameReader` of this protocol's frames on ``sock``."""
        stall = self.stall_timeout if stall_timeout is None else stall_timeout
        return FrameReader(sock, self, stall)

    def send(self, sock: socket.socket, message: M, deadline: float | None = None) -> None:
        """Encode and :func:`send` ``message``."""
        send(sock, self.encode(message), deadline)


class FrameReader(Generic[M]):
    """Reads whole frames of one :class:`Framing` from a blocking socket, keeping any bytes
    past the current frame. Both local sockets (the server's, the vLLM lookup channel) and
    their clients read with it.

    Deadlines are for whole frames, never per ``recv`` (a peer that trickles one byte at a
    time must not hold a connection open forever)::

        read(deadline)   the whole message must have arrived by ``deadline`` (monotonic);
                         missing it is a TransferTimeout (the peer did not answer in time)
        read()           waiting for a frame to begin: the idle timeout (the socket's own at
                         construction, or :meth:`set_idle_timeout`; None: forever), missing it
                         a ProtocolError; either way, once its first byte came, the frame
                         must be whole within ``stall_timeout`` of that byte, or it is a
                         ProtocolError (the frame counts as truncated)
    """

    def __init__(self, sock: socket.socket, framing: Framing[M], stall_timeout: float) -> None:
        self.sock = sock
        self.framing = framing
        self.stall_timeout = stall_timeout
        self._buf = bytearray()
        self._idle_timeout = sock.gettimeout()
        self._seen = False

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

    def read(self, deadline: float | None = None) -> M | None:
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
            length = self.framing.parse_header(memoryview(self._buf)[: HEADER.size])
            end = HEADER.size + length
            while len(self._buf) < end:
                if not self._recv(frame):
                    got = len(self._buf) - HEADER.size
                    raise ProtocolError(f"truncated frame body ({got} of {length} bytes, then EOF)")
        finally:
            with contextlib.suppress(OSError):
                self.sock.settimeout(self._idle_timeout)
        body = bytes(memoryview(self._buf)[HEADER.size : end])
        del self._buf[:end]
        return self.framing.decode_body(body)

    def _recv(self, frame: _Deadline) -> bool:
        sock = self.sock
        try:
            sock.settimeout(frame.left(self._idle_timeout))
            data = sock.recv(1 << 16)
        except TimeoutError:
            raise frame.missed() from None
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
            raise self.missed()
        return left

    def missed(self) -> TransferError:
        if self.at is not None and self.at == self.deadline:
            return TransferTimeout("the peer did not answer in time (message not whole)")
        if self.begun:
            return ProtocolError(
                f"frame stalled: not whole within {self.stall:g} s of its first byte"
            )
        return ProtocolError("no frame within the idle timeout")


def recv_exact(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill ``view`` from ``sock``, straight into it (no intermediate buffer). With
    ``deadline`` (monotonic) the whole of it by then, whatever the peer's pace: the socket's
    timeout is set to what is left before every ``recv_into``, so a peer that trickles a byte
    at a time cannot stretch one read past it (:class:`TransferTimeout`). Without one, the
    socket's own timeout bounds each wait."""
    _receive(sock, view, deadline, at_least=len(view))


def _receive(sock: socket.socket, view: memoryview, deadline: float | None, at_least: int) -> int:
    """Receive into ``view`` until ``at_least`` bytes came (returns how many: more is fine,
    up to ``len(view)``); 0 only when the peer closed the connection before the first."""
    got, want = 0, len(view)
    before = sock.gettimeout() if deadline is not None else None
    try:
        while got < at_least:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                sock.settimeout(left)
            n = sock.recv_into(view[got:], want - got)
            if n == 0:
                if got == 0 and at_least < want:
                    return 0  # closed between frames
                raise TransferError(f"peer closed the connection ({got} of {want} bytes received)")
            got += n
    except TimeoutError:
        raise TransferTimeout(f"peer stalled ({got} of {want} bytes received)") from None
    except OSError as exc:
        raise TransferError(f"connection lost while receiving: {exc}") from None
    finally:
        if deadline is not None:
            with contextlib.suppress(OSError):
                sock.settimeout(before)
    return got


def read_message(
    sock: socket.socket, framing: Framing[M], deadline: float | None = None
) -> M | None:
    """The next frame of ``framing`` on ``sock``, read exactly (never a byte past it, so the
    next frame may belong to another protocol), or None when the peer closed the connection
    between frames. The header is checked before the body is allocated: at most
    ``framing.max_body`` bytes are ever taken for a peer's frame. ``deadline``: the whole
    frame by then (:func:`recv_exact`)."""
    header = bytearray(HEADER.size)
    first = _receive(sock, memoryview(header), deadline, at_least=1)
    if first == 0:
        return None  # closed between frames
    try:
        recv_exact(sock, memoryview(header)[first:], deadline)
    except TransferTimeout:
        raise
    except TransferError as exc:
        raise ProtocolError(f"truncated frame header: {exc}") from None
    body = bytearray(framing.parse_header(header))
    try:
        recv_exact(sock, memoryview(body), deadline)
    except TransferTimeout:
        raise
    except TransferError as exc:
        raise ProtocolError(f"truncated frame body: {exc}") from None
    return framing.decode_body(body)


def send(
    sock: socket.socket, data: bytes | bytearray | memoryview, deadline: float | None = None
) -> None:
    """Send the encoded frame(s) ``data`` whole; with ``deadline`` (monotonic), by then or
    :class:`TransferTimeout` (a peer that does not read its replies cannot hold a thread)."""
    before = sock.gettimeout()
    try:
        if deadline is not None:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
        sock.sendall(data)
    except TimeoutError:
        raise TransferTimeout("the peer did not take the message in time") from None
    except OSError as exc:
        raise TransferError(f"connection lost while sending: {exc}") from None
    finally:
        if deadline is not None:
            with contextlib.suppress(OSError):
                sock.settimeout(before)
