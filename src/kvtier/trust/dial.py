"""Dialing a kvtier port: connect and authenticate within one deadline.

Every dialer (the PD sender, the PD puller, P2P followers and pullers) connects here, so
the handshake it runs is the one :mod:`kvtier.trust.handshake` defines and the time it may
take is bounded as a whole: reaching the address and proving the token share one deadline.
"""

from __future__ import annotations

import contextlib
import random
import socket
import time

from kvtier.errors import TransferError, TransferTimeout
from kvtier.trust import handshake


def connect(
    host: str, port: int, me: handshake.Credentials, deadline: float, where: str
) -> tuple[socket.socket, str]:
    """A connection to ``host:port`` that passed the handshake, and the listener's identity.
    The socket is left blocking with no timeout: the caller bounds every later wait. Raises
    :class:`TransferError` (unreachable), :class:`AuthError`, :class:`ProtocolError` or
    :class:`TransferTimeout`; the socket is closed on every failure."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransferTimeout(f"no time left to reach {where}")
    try:
        sock = socket.create_connection((host, port), timeout=left)
    except TimeoutError:
        raise TransferTimeout(f"{where} did not accept the connection in time") from None
    except OSError as exc:
        raise TransferError(f"cannot reach {where}: {exc}") from None
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(None)
        identity = handshake.dial(sock, me, deadline, where)
    except BaseException:
        with contextlib.suppress(OSError):
            sock.close()
        raise
    return sock, identity


class Backoff:
    """How long to wait before dialing a lost peer again: ``initial`` seconds, doubling to
    ``cap`` while it keeps failing (with jitter, so a fleet does not redial in step), back
    to ``initial`` once a connection has lasted."""

    def __init__(self, initial: float = 1.0, cap: float = 30.0) -> None:
        self.initial = initial
        self.cap = cap
        self._next = initial

    def failed(self) -> float:
        """The wait before the next dial, after a failure."""
        wait = self._next
        self._next = min(self.cap, self._next * 2)
        return wait * random.uniform(0.8, 1.0)

    def succeeded(self) -> None:
        self._next = self.initial
