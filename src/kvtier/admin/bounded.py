"""A threading HTTP server whose clients cannot hold it: the admin API's transport.

The standard library's ``ThreadingHTTPServer`` gives each connection a thread, without limit,
and a per-read timeout only, so a client sending one header line every few seconds holds its
thread forever, and ``server_close`` joins every thread. Here:

* at most ``max_handlers`` connections are handled at once; one more is answered 503 at
  once, from the serve thread, without a thread of its own;
* each connection has ``request_timeout`` seconds in all, request and answer, however slowly
  its bytes come: past it the serve thread (``service_actions``, between polls) shuts the
  socket down, and the handler, reading or writing, ends;
* ``drop_connections`` shuts every held connection down and waits a bounded time, so closing
  never waits on a client;
* a client that goes away mid-request is a debug line, never a traceback on stderr.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import socket
import sys
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger("kvtier.admin.server")  # one logger for the whole admin API

REQUEST_TIMEOUT = 10.0  # seconds a connection may take, request and answer together
MAX_HANDLERS = 32  # requests handled at once
_REFUSED_LINGER = 1.0  # a refused connection stays open this long, for the client to read
_MAX_REFUSED = 256
_BUSY = json.dumps({"error": "too many admin requests at once; try again"}).encode()
_BUSY_REPLY = (
    b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
) % (len(_BUSY), _BUSY)


class BoundedHTTPServer(ThreadingHTTPServer):
    # Handler threads are tracked here, not by ThreadingMixIn (whose server_close joins them
    # without a bound): close drops their connections, then waits a bounded time.
    daemon_threads = True
    block_on_close = False

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        *,
        request_timeout: float = REQUEST_TIMEOUT,
        max_handlers: int = MAX_HANDLERS,
    ) -> None:
        self.request_timeout = request_timeout
        self.max_handlers = max_handlers
        self._lock = threading.Lock()
        self._deadlines: dict[socket.socket, float] = {}  # connection -> when it is dropped
        self._dropped: set[socket.socket] = set()
        self._handlers: set[threading.Thread] = set()
        self._refused: deque[tuple[float, socket.socket]] = deque()  # serve thread only
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            full = len(self._handlers) >= self.max_handlers
            if not full:
                self._deadlines[request] = time.monotonic() + self.request_timeout
                thread = threading.Thread(
                    target=self.process_request_thread,
                    args=(request, client_address),
                    name="kvtier-admin-request",
                    daemon=True,
                )
                self._handlers.add(thread)
        if full:
            self._refuse(request)
        else:
            thread.start()

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._lock:
                self._deadlines.pop(request, None)
                self._dropped.discard(request)
                self._handlers.discard(threading.current_thread())

    def _refuse(self, request: socket.socket) -> None:
        """A 503 without a thread. The socket stays open a moment (closed from
        ``service_actions``) so that the request the client is still sending does not
        turn our close into a reset that destroys the answer before it is read."""
        with contextlib.suppress(OSError):
            request.setblocking(False)
            _drain(request)
            request.send(_BUSY_REPLY)
            request.shutdown(socket.SHUT_WR)
        self._refused.append((time.monotonic() + _REFUSED_LINGER, request))
        while len(self._refused) > _MAX_REFUSED:
            _close(self._refused.popleft()[1])

    def service_actions(self) -> None:
        """Runs in the serve thread between polls: drop connections past their deadline,
        close refused ones whose moment has passed."""
        now = time.monotonic()
        with self._lock:
            overdue = [conn for conn, deadline in self._deadlines.items() if now > deadline]
            for conn in overdue:
                self._deadlines[conn] = math.inf  # dropped once
                self._dropped.add(conn)
        for conn in overdue:
            log.info("admin connection dropped: no complete request in %gs", self.request_timeout)
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        while self._refused and self._refused[0][0] <= now:
            _close(self._refused.popleft()[1])

    def dropped(self, conn: socket.socket) -> bool:
        with self._lock:
            return conn in self._dropped

    def drop_connections(self, timeout: float) -> list[threading.Thread]:
        """Shut down every connection held by a handler and wait up to ``timeout`` seconds
        for the handlers to end. Returns those still running (stuck outside the socket)."""
        with self._lock:
            conns = list(self._deadlines)
            self._dropped.update(conns)
            handlers = list(self._handlers)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        while self._refused:
            _close(self._refused.popleft()[1])
        deadline = time.monotonic() + timeout
        for thread in handlers:
            thread.join(max(0.0, deadline - time.monotonic()))
        return [thread for thread in handlers if thread.is_alive()]

    def handle_error(self, request: Any, client_address: Any) -> None:
        # The default prints a traceback to stderr. A socket error is a client that went
        # away (or one we dropped): routine. Anything else is a bug: logged with its trace.
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):
            log.debug("admin connection from %s ended: %s", client_address, exc)
        else:
            log.exception("admin API bug serving %s", client_address)


def _drain(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        for _ in range(16):
            if not sock.recv(65536):
                return


def _close(sock: socket.socket) -> None:
    _drain(sock)
    with contextlib.suppress(OSError):
        sock.close()
