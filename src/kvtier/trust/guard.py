"""Bounds on a port's connections: how many at once (and how many not yet authenticated),
and how long each may keep its thread waiting. Every port another kvtier process dials (PD
push, PD pull, P2P) and the PD puller's own connections are held to them.

A peer holds a thread for as long as the thread waits on its socket, and a per-read
socket timeout does not bound that: a byte every few seconds resets it. So each connection
has a deadline for what the receiver waits for next (the handshake, the next message of a
request, the next request), set by the serving thread with :meth:`ConnectionGuard.expect`,
and one watchdog thread shuts down the socket of any connection past its deadline: the
blocked read returns, and the serving thread releases what its request held and exits.
:meth:`ConnectionGuard.admit` refuses connections beyond ``max_connections``, and beyond
``max_pending`` not yet authenticated, so a flood of peers that never prove themselves holds
at most that many threads (each with a header's worth of memory, :mod:`kvtier.trust.handshake`)
and leaves the rest of the port to peers that did.

The watchdog also runs the port's periodic work (``on_tick``: a PD receiver expires
reservations nobody claimed), so a port has exactly two threads besides one per connection.
"""

from __future__ import annotations

import contextlib
import logging
import math
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

WATCH_INTERVAL = 0.2  # how late past its deadline a stalled connection may be closed
REFUSAL_LOG_INTERVAL = 10.0  # one log line per this many seconds under a flood


@dataclass
class Connection:
    """One sender connection and the deadline the watchdog holds it to."""

    sock: socket.socket
    peer: str
    deadline: float  # time.monotonic(); past it the watchdog shuts the socket down
    waiting_for: str  # the log line if the deadline passes
    overdue: str = ""  # set by the watchdog when it closed the connection
    authenticated: bool = False  # the handshake passed (ConnectionGuard.authenticated)


class ConnectionGuard:
    def __init__(
        self,
        *,
        max_connections: int,
        handshake_timeout: float,
        on_tick: Callable[[], None] | None = None,
        max_pending: int | None = None,
        limit_key: str = "pd_max_connections",
        logger: logging.Logger | None = None,
    ) -> None:
        """``max_pending``: connections not yet authenticated (default: a quarter of
        ``max_connections``, at least 4); ``limit_key`` names the cap in the log line of a
        refusal."""
        self.max_connections = max_connections
        self.max_pending = max_pending if max_pending is not None else max(4, max_connections // 4)
        self.limit_key = limit_key
        self._log = logger if logger is not None else logging.getLogger("kvtier.pd.receiver")
        self.handshake_timeout = handshake_timeout
        self._on_tick = on_tick
        self._conns: dict[socket.socket, Connection] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._last_refusal_log = -math.inf
        self.refused = 0  # connections closed at once: max_connections (or max_pending) open
        self.timeouts = 0  # connections closed past their deadline

    def open(self) -> None:
        self._thread = threading.Thread(target=self._watch, name="kvtier-pd-watchdog", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop watching and shut every connection down (their threads then end)."""
        with self._cond:
            self._closed = True
            conns = list(self._conns)
            self._cond.notify_all()
        for sock in conns:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        if self._thread is not None:
            self._thread.join(timeout=10.0)

    def __len__(self) -> int:
        with self._cond:
            return len(self._conns)

    def admit(self, sock: socket.socket, peer: str) -> Connection | None:
        """The new connection, its handshake deadline running; None (and the socket closed)
        when ``max_connections`` are open, ``max_pending`` are still in their handshake, or
        the guard is closed."""
        with self._cond:
            closed = self._closed
            pending = sum(1 for c in self._conns.values() if not c.authenticated)
            if (
                not closed
                and len(self._conns) < self.max_connections
                and pending < self.max_pending
            ):
                deadline = time.monotonic() + self.handshake_timeout
                waiting = f"no handshake within {self.handshake_timeout:g}s"
                conn = self._conns[sock] = Connection(sock, peer, deadline, waiting)
                return conn
            if not closed:
                self.refused += 1
            count = self.refused
        sock.close()
        now = time.monotonic()
        if not closed and now - self._last_refusal_log >= REFUSAL_LOG_INTERVAL:
            self._last_refusal_log = now
            self._log.warning(
                "connection from %s refused: %d connections open (%s), or %d not yet "
                "authenticated; %d refused so far",
                peer,
                self.max_connections,
                self.limit_key,
                self.max_pending,
                count,
            )
        return None

    def authenticated(self, conn: Connection) -> None:
        """``conn`` passed its handshake: it no longer counts against ``max_pending``."""
        with self._cond:
            conn.authenticated = True

    def expect(self, conn: Connection, seconds: float, overdue: str) -> None:
        """From now, the peer has ``seconds`` (inf: no limit) for its next step; past it the
        connection is shut down, logged as ``overdue``."""
        with self._cond:
            conn.deadline = time.monotonic() + seconds
            conn.waiting_for = overdue

    def leave(self, conn: Connection) -> None:
        with self._cond:
            self._conns.pop(conn.sock, None)

    def overdue(self, conn: Connection) -> None:
        """``conn`` missed its deadline, seen by its own read rather than the watchdog:
        counted once, as the watchdog would have."""
        with self._cond:
            if not conn.overdue:
                conn.overdue = conn.waiting_for
                self.timeouts += 1

    def _watch(self) -> None:
        while True:
            with self._cond:
                if self._cond.wait_for(lambda: self._closed, WATCH_INTERVAL):
                    return
                now = time.monotonic()
                overdue = [c for c in self._conns.values() if not c.overdue and now > c.deadline]
                for conn in overdue:
                    conn.overdue = conn.waiting_for
                    self.timeouts += 1
            for conn in overdue:
                with contextlib.suppress(OSError):
                    conn.sock.shutdown(socket.SHUT_RDWR)
            if self._on_tick is not None:
                self._on_tick()
