"""The client's end of one server connection: connect, handshake, map, reconnect with backoff.

Not thread-safe by itself: :class:`~kvtier.server.client.ServerClient` uses it under its lock.

Backoff: after a failed connect (no server, a server that refused) the next attempt waits
``backoff`` seconds, doubling up to ``max_backoff``; calls made meanwhile are misses at once,
with no syscall. A connection that breaks mid-call is retried at the next call. A connect
succeeds in well under a millisecond on a live server, so a restarted server is found again
within ``max_backoff``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable

import torch

from kvtier import local_sockets
from kvtier.errors import ProtocolError, TransferError
from kvtier.framing import FrameReader
from kvtier.server import protocol as wire
from kvtier.server.shared_memory import map_pages

log = logging.getLogger(__name__)


class ServerRefused(TransferError):
    """The server answered the handshake with Refused (quota, capacity, peer check)."""


class ServerLink:
    """A link (a client's self-healing connection to one server, like ``RedisLink``) to the
    kvtier server: see the module docstring."""

    def __init__(
        self,
        path: str,
        hello: wire.Hello,
        timeout: float,
        *,
        first_backoff: float = 0.05,
        max_backoff: float = 2.0,
        server_uid: int | None = None,
        locate: Callable[[], str] | None = None,
    ) -> None:
        self.path = path
        self._locate = locate  # a default path: the server may have moved aside at its start
        self.server_uid = os.geteuid() if server_uid is None else server_uid
        self.hello = hello
        self.timeout = timeout
        self.first_backoff = first_backoff
        self.max_backoff = max_backoff
        self.sock: socket.socket | None = None
        self.reader: FrameReader[wire.Message] | None = None
        self.pages: torch.Tensor | None = None  # the model's page buffer, mapped
        self.page_bytes = 0
        self.server_pid = 0
        self.connects = 0
        self.last_error = ""
        self._backoff = 0.0
        self._next_try = 0.0

    @property
    def connected(self) -> bool:
        return self.sock is not None

    def ensure(self) -> bool:
        """Connected, connecting now if the backoff allows. Never raises."""
        if self.sock is not None:
            return True
        now = time.monotonic()
        if now < self._next_try:
            return False
        try:
            self._connect()
        except (OSError, TransferError) as exc:
            self._backoff = min(self.max_backoff, max(self.first_backoff, self._backoff * 2))
            self._next_try = time.monotonic() + self._backoff
            message = str(exc)
            if message != self.last_error:  # one line per new reason, not one per call
                log.warning("kvtier server %s unavailable (%s); serving misses", self.path, exc)
            self.last_error = message
            return False
        self._backoff = 0.0
        self.connects += 1
        self.last_error = ""
        log.info("connected to the kvtier server at %s (pid %d)", self.path, self.server_pid)
        return True

    def call(self, request: wire.Request) -> wire.Reply:
        """Send ``request`` and read its reply. Raises TransferError (ProtocolError included)
        when the connection breaks; the caller then calls :meth:`drop`."""
        assert self.sock is not None and self.reader is not None, "ensure() first"
        wire.send(self.sock, request)
        reply = self.reader.read()
        if reply is None:
            raise TransferError("the kvtier server closed the connection")
        if isinstance(reply, wire.Request):
            raise ProtocolError(f"the server sent a {type(reply).__name__}, not a reply")
        return reply

    def drop(self, why: str) -> None:
        if self.sock is not None:
            log.warning("lost the kvtier server at %s (%s); serving misses", self.path, why)
            with contextlib.suppress(OSError):
                self.sock.close()
        self.sock = self.reader = self.pages = None
        self._next_try = 0.0  # a broken connection is retried at the next call

    def close(self) -> None:
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.close()
        self.sock = self.reader = self.pages = None

    def _connect(self) -> None:
        # Trust nothing from a listener of another uid: it may have bound the path first.
        if self._locate is not None:
            self.path = self._locate()
        what = f"the kvtier server at {self.path}"
        sock = local_sockets.connect(self.path, self.timeout, self.server_uid, what)
        try:
            wire.send(sock, self.hello)
            data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 1)
            try:
                if not data:
                    raise TransferError("the server closed the connection during the handshake")
                reader = wire.reader(sock)
                reader.feed(data)
                reply = reader.read()
                if isinstance(reply, wire.Refused):
                    raise ServerRefused(f"refused: {reply.message}")
                if not isinstance(reply, wire.Welcome) or len(fds) != 1:
                    raise ProtocolError(
                        f"expected Welcome with one descriptor, got {type(reply).__name__} "
                        f"with {len(fds)}"
                    )
                pages = map_pages(fds.pop(), reply.num_pages * reply.page_bytes)
            finally:
                for fd in fds:
                    with contextlib.suppress(OSError):
                        socket.close(fd)
        except BaseException:
            sock.close()
            raise
        self.sock, self.reader, self.pages = sock, reader, pages
        self.page_bytes = reply.page_bytes
        self.server_pid = reply.server_pid
