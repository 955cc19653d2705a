"""Client connections and what each holds: released together, at once, when it goes.

A lease belongs to (connection, request id): the server names a client's request ``rid`` as
``c<connection>/<rid>`` in its engine, and a store in flight as ``c<connection>#store<id>``
(a reservation of pages the client is filling). When the connection ends, however it ends
(a clean close, a protocol error, the client killed with SIGKILL: the kernel closes its
socket), :meth:`Session.release_all` ends every one of those requests: pins and reserved
pages go back in one step, and nothing waits for a timeout.
"""

from __future__ import annotations

import itertools
import socket
import threading

from kvtier.engine import Engine
from kvtier.server.models import ModelSlot
from kvtier.storage.manager import StoreSlot


class Session:
    def __init__(self, number: int, sock: socket.socket, pid: int, uid: int) -> None:
        self.number = number
        self.sock = sock
        self.pid = pid
        self.uid = uid
        self.slot: ModelSlot | None = None
        self._requests: set[str] = set()  # every engine request id this connection used
        self.store: tuple[int, str, list[StoreSlot]] | None = None  # the one store in flight

    def __str__(self) -> str:
        return f"client {self.number} (pid {self.pid})"

    def request_id(self, client_request_id: str) -> str:
        rid = f"c{self.number}/{client_request_id}"
        self._requests.add(rid)
        return rid

    def store_request_id(self, store_id: int) -> str:
        rid = f"c{self.number}#store{store_id}"
        self._requests.add(rid)
        return rid

    def forget(self, rid: str) -> None:
        self._requests.discard(rid)

    def pinned_pages(self, engine: Engine) -> int:
        """Pages this connection's requests hold pinned in ``engine`` now."""
        mine = self._requests
        return sum(info.pinned_pages for info in engine.leases() if info.request_id in mine)

    @property
    def open_requests(self) -> int:
        return len(self._requests)

    def release_all(self) -> int:
        """End every request of this connection; returns how many still held something."""
        self.store = None
        requests, self._requests = self._requests, set()
        if self.slot is None:
            return 0
        engine = self.slot.engine
        return sum(1 for rid in requests if engine.end_request(rid))


class SessionTable:
    """The connections being served, at most ``max_clients`` at once."""

    def __init__(self, max_clients: int) -> None:
        self.max_clients = max_clients
        self._sessions: dict[int, Session] = {}
        self._numbers = itertools.count(1)
        self._lock = threading.Lock()

    def admit(self, sock: socket.socket, pid: int, uid: int) -> Session | None:
        """A session for a new connection, or None when ``max_clients`` are being served."""
        with self._lock:
            if len(self._sessions) >= self.max_clients:
                return None
            session = Session(next(self._numbers), sock, pid, uid)
            self._sessions[session.number] = session
            return session

    def remove(self, session: Session) -> None:
        with self._lock:
            self._sessions.pop(session.number, None)

    def all(self) -> list[Session]:
        with self._lock:
            return list(self._sessions.values())

    def __len__(self) -> int:
        return len(self._sessions)
