"""Client connections and what each holds: released together, at once, when it goes.

A lease belongs to (connection, request id): the server names a client's request ``rid`` as
``c<connection>/<rid>`` in its engine, and a store in flight as ``c<connection>#store<id>``
(a reservation of pages the client is filling). When the connection ends, however it ends
(a clean close, a protocol error, the client killed with SIGKILL: the kernel closes its
socket), :meth:`Session.release_all` ends every one of those requests: pins and reserved
pages go back in one step, and nothing waits for a timeout.

What one connection may hold open, so that a client that never ends its requests cannot
grow the server without bound (:meth:`Session.admit` refuses past either, with
:class:`~kvtier.errors.CapacityError` naming the key that raises it)::

    server_client_max_requests   requests open at once (looked up, not ended; stores aside)
    server_client_max_tokens     tokens whose keys the engine keeps for them, all together
                                 (each open request: the tokens of its last lookup)

A lookup that pinned nothing does not stay open (the handler ends it at once), so misses
never count against either bound.
"""

from __future__ import annotations

import hashlib
import itertools
import socket
import threading
from dataclasses import dataclass

from kvtier.engine import Engine
from kvtier.errors import CapacityError
from kvtier.request_salt import RequestSalt
from kvtier.server.models import ModelSlot
from kvtier.storage.writes import StoreSlot


@dataclass
class OpenRequest:
    """What the server knows of one open request of a connection."""

    tokens: int = 0  # tokens its lease keeps the keys of (its last lookup's)
    hit: int = 0  # its last lookup's hit, in tokens
    salt: RequestSalt | None = None
    prefix: bytes = b""  # digest of the hit's token bytes (see Session.same_prefix)
    store: bool = False  # a store in flight, not a request of the client's


class Session:
    def __init__(self, number: int, sock: socket.socket, pid: int, uid: int) -> None:
        self.number = number
        self.sock = sock
        self.pid = pid
        self.uid = uid
        self.slot: ModelSlot | None = None
        self._requests: dict[str, OpenRequest] = {}  # engine request id -> what it holds
        self.store: tuple[int, str, list[StoreSlot]] | None = None  # the one store in flight

    def __str__(self) -> str:
        return f"client {self.number} (pid {self.pid})"

    def request_id(self, client_request_id: str) -> str:
        """The engine's name of the client's request (opening nothing)."""
        return f"c{self.number}/{client_request_id}"

    def store_request_id(self, store_id: int) -> str:
        rid = f"c{self.number}#store{store_id}"
        self._requests[rid] = OpenRequest(store=True)
        return rid

    def admit(self, rid: str, tokens: int) -> bool:
        """Record that ``rid`` is open and keeps ``tokens`` tokens' keys; True when this
        opens it. Raises :class:`CapacityError`, recording nothing, past the connection's
        bounds (see the module docstring)."""
        config = self.slot.engine.config if self.slot is not None else None
        known = self._requests.get(rid)
        if config is not None:
            limit = config.server_client_max_requests
            open_now = sum(1 for r in self._requests.values() if not r.store)
            if known is None and open_now >= limit:
                raise CapacityError(
                    f"{self} has {open_now} requests open, the most server_client_max_requests "
                    f"({limit}) allows: end some (end_request) or raise "
                    "server_client_max_requests"
                )
            limit = config.server_client_max_tokens
            held = sum(r.tokens for r in self._requests.values())
            total = held - (known.tokens if known is not None else 0) + tokens
            if total > limit:
                raise CapacityError(
                    f"{self} would keep the keys of {total} tokens in open requests, more "
                    f"than server_client_max_tokens ({limit}) allows: end some requests "
                    "(end_request) or raise server_client_max_tokens"
                )
        if known is None:
            self._requests[rid] = OpenRequest(tokens=tokens)
            return True
        known.tokens = tokens
        return False

    def looked_up(self, rid: str, hit: int, salt: RequestSalt | None, raw: bytes) -> None:
        """``rid``'s lookup of the int32 tokens ``raw`` hit ``hit`` tokens (pinned)."""
        request = self._requests.setdefault(rid, OpenRequest())
        request.hit, request.salt, request.prefix = hit, salt, _digest(raw[: 4 * hit])

    def same_prefix(self, rid: str, raw: bytes, salt: RequestSalt | None) -> bool:
        """Whether a Retrieve of ``raw`` for ``rid`` reads the prefix its lookup pinned: the
        engine then reuses that lookup's pins and takes no new ones. Anything else (no
        lookup, another prompt or salt) makes the engine look the tokens up again."""
        request = self._requests.get(rid)
        if request is None or request.store or request.salt != salt:
            return False
        return len(raw) >= 4 * request.hit and _digest(raw[: 4 * request.hit]) == request.prefix

    def forget(self, rid: str) -> None:
        self._requests.pop(rid, None)

    def pinned_pages(self, engine: Engine) -> int:
        """Pages this connection's requests hold pinned in ``engine`` now."""
        mine = self._requests
        return sum(info.pinned_pages for info in engine.leases() if info.request_id in mine)

    @property
    def open_requests(self) -> int:
        return len(self._requests)

    @property
    def open_tokens(self) -> int:
        return sum(r.tokens for r in self._requests.values())

    def release_all(self) -> int:
        """End every request of this connection; returns how many still held something."""
        self.store = None
        requests, self._requests = self._requests, {}
        if self.slot is None:
            return 0
        engine = self.slot.engine
        return sum(1 for rid in requests if engine.end_request(rid))


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


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
