"""A port another kvtier process dials: accept, bound, authenticate, then hand over.

One class for every such port (the PD receiver, the PD source, the P2P node), so none writes
its own accept loop, caps or handshake::

    accept ─▶ guard.admit ─▶ thread ─▶ handshake.accept ─▶ guard.authenticated ─▶ serve(conn, peer)
              (cap: max_connections,    (one deadline for     (from here the         (the protocol's
               max_pending unproven)     the whole exchange)    pending cap frees)     own loop)

A refused handshake (wrong token, none, another protocol, too slow) is counted through
``on_refused`` and logged once per interval per address and cause, naming the cause; a peer's
words reach the log through :func:`~kvtier.trust.peer_text.peer_text`. Whatever ``serve``
does, the connection leaves the guard and its socket closes when it returns.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Callable

from kvtier.errors import AuthError, ProtocolError, TransferError, TransferTimeout
from kvtier.repeated_log import RepeatedLog
from kvtier.trust import handshake
from kvtier.trust.guard import Connection, ConnectionGuard

FAILURE_LOG_INTERVAL = 30.0  # one line per address and cause per this many seconds

Serve = Callable[[Connection, str], None]


def failure_cause(exc: TransferError) -> str:
    """A refused handshake's cause, in the words an operator looks for."""
    if isinstance(exc, AuthError):
        return "wrong or missing token"
    if isinstance(exc, TransferTimeout):
        return "timed out"
    if isinstance(exc, ProtocolError):
        return "not a kvtier peer of this protocol"
    return "connection lost"


class TrustedPort:
    def __init__(
        self,
        *,
        name: str,
        host: str,
        port: int,
        credentials: handshake.Credentials,
        guard: ConnectionGuard,
        serve: Serve,
        logger: logging.Logger,
        on_refused: Callable[[Connection, TransferError], None] | None = None,
    ) -> None:
        """``name``: what the port is, for thread names and log lines ("PD receiver")."""
        self.name = name
        self.host = host
        self.port = port
        self.credentials = credentials
        self.guard = guard
        self._serve = serve
        self._log = logger
        self._failures = RepeatedLog(logger, FAILURE_LOG_INTERVAL)
        self._on_refused = on_refused
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    def open(self) -> TrustedPort:
        listener = socket.create_server((self.host, self.port))
        self.port = listener.getsockname()[1]
        self._listener = listener
        self.guard.open()
        self._spawn(self._accept_loop, f"kvtier-{self.credentials.protocol}-accept")
        return self

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            listener, self._listener = self._listener, None
        if listener is not None:
            # close() alone does not wake a thread blocked in accept(); shutdown() does.
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        self.guard.close()  # shuts every connection down: their threads end
        for thread in list(self._threads):
            thread.join(timeout=10.0)

    @property
    def threads(self) -> int:
        """Threads of this port still running (the accept loop's included)."""
        return sum(1 for t in self._threads if t.is_alive())

    def _spawn(self, target: Callable[..., None], name: str, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        thread.start()

    def _accept_loop(self) -> None:
        listener = self._listener
        assert listener is not None
        while True:
            try:
                conn, addr = listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed:
                    conn.close()
                    return
            state = self.guard.admit(conn, f"{addr[0]}:{addr[1]}")
            if state is None:
                continue  # refused: the caps are full (counted and logged by the guard)
            self._spawn(self._run, f"kvtier-{self.credentials.protocol}-{addr[1]}", state)

    def _run(self, state: Connection) -> None:
        sock = state.sock
        try:
            sock.settimeout(None)  # every wait below has its own deadline
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            deadline = state.deadline  # the guard's: one deadline for the whole exchange
            try:
                peer = handshake.accept(sock, self.credentials, deadline)
            except TransferError as exc:
                self._refused(state, exc)
                return
            except OSError as exc:
                self._refused(state, TransferError(f"connection lost: {exc}"))
                return
            self.guard.authenticated(state)
            self._serve(state, peer)
        finally:
            self.guard.leave(state)
            with contextlib.suppress(OSError):
                sock.close()

    def _refused(self, state: Connection, exc: TransferError) -> None:
        if isinstance(exc, TransferTimeout):
            self.guard.overdue(state)  # the read's deadline beat the watchdog's: one count
        if state.overdue:  # whatever the read saw, the deadline closed it: a timeout
            exc = TransferTimeout(state.overdue)
        if self._on_refused is not None:
            self._on_refused(state, exc)
        cause = failure_cause(exc)
        host = state.peer.rpartition(":")[0]
        self._failures.warning(
            (host, cause),
            "%s: handshake with %s refused (%s): %s",
            self.name,
            state.peer,
            cause,
            exc,
        )
