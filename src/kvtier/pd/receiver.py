"""The decoder side: serves senders, filling the PD tier's receive buffer.

One thread accepts connections; one thread per connection runs the protocol of
:mod:`kvtier.pd.protocol` for that sender's requests, one at a time. Per request:

1. ``AllocRequest``: the PD tier reserves every chunk at once (held keys take one reference
   for this request, nothing more) and the reservation goes into the decoder request's lease
   through ``attach(request_id, reservation)``: ``end_request`` gives it back, whichever way
   the request ends. A full buffer waits up to ``pd_allocation_timeout_sec``, then both
   sides get :class:`TransferTimeout` and the decoder prefills locally.
2. ``ChunkSent``: the payload lands in its page (tcp: ``recv_into`` the page), is verified and
   published: from then on the decoder's lookup finds it.
3. ``RequestDone`` / ``Abort`` / the connection dropping / a malformed frame: the outcome is
   recorded for the decoder (``wait_outcome``); on every failure the reservation is released
   at once (the lease's later release is then a no-op).

What a peer must do before any of that, and what bounds it (docs/security.md):

* prove it knows ``pd_auth_token`` (:mod:`kvtier.pd.auth`); without a token the receiver
  refuses to listen beyond loopback;
* at most ``pd_max_connections`` connections at once: more are closed as they arrive;
* a deadline per wait (:mod:`kvtier.pd.guard`: its watchdog shuts the socket down past it):
  the handshake and each message of a request within ``pd_message_timeout_sec``, the next
  request within ``pd_idle_timeout_sec``;
* a request the decoder has not looked up ``pd_reservation_ttl_sec`` after its reservation
  arrived is ended from the same watchdog (``expire_unclaimed``): its pages go back, once.

Threads start in :meth:`open` and stop in :meth:`close`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Protocol

from kvtier.config import Config
from kvtier.errors import (
    AuthError,
    KVTierError,
    ProtocolError,
    StateError,
    TransferError,
    TransferTimeout,
)
from kvtier.keys import ChunkKey, Fingerprint
from kvtier.lease import Hold
from kvtier.pd.auth import challenge_sender, check_listen
from kvtier.pd.buffer import PDBuffer, TooLarge
from kvtier.pd.guard import Connection, ConnectionGuard
from kvtier.pd.protocol import (
    Abort,
    AllocReply,
    AllocRequest,
    ChunkSent,
    DoneReply,
    ErrorReply,
    Hello,
    HelloReply,
    Message,
    RequestDone,
    recv_message,
    send_message,
)
from kvtier.pd.reservation import Reservation

log = logging.getLogger(__name__)

MAX_UNCOLLECTED_OUTCOMES = 10_000

Attach = Callable[[str, Hold], None]
Expire = Callable[[float, Collection[str]], list[str]]


class ReceiverHost(Protocol):
    """The decoder's engine as the receiver sees it: ``Engine.receiver_host()`` returns one
    (:class:`kvtier.pd.host.EngineReceiverHost`)."""

    config: Config
    fingerprint: Fingerprint

    @property
    def pd_buffer(self) -> PDBuffer | None: ...

    def attach_hold(self, request_id: str, hold: Hold) -> None: ...

    def expire_unclaimed(self, ttl: float, busy: Collection[str] = ()) -> list[str]: ...


class HostsReceiver(Protocol):
    """What :meth:`PDReceiver.for_engine` takes: an engine that can show itself as a
    :class:`ReceiverHost` (``kvtier.engine.Engine``)."""

    def receiver_host(self) -> ReceiverHost: ...


@dataclass(frozen=True, slots=True)
class TransferOutcome:
    """How one request's transfer ended, as the decoder learns it."""

    ok: bool
    reason: str = ""
    chunks: int = 0  # chunks received and published
    held: int = 0  # chunks the decoder already had
    nbytes: int = 0


@dataclass
class _InFlight:
    request: AllocRequest
    reservation: Reservation
    pending: dict[int, int]  # key position -> page, for chunks not received yet
    held: int
    chunks: int = 0
    nbytes: int = 0
    corrupt: list[int] = field(default_factory=list)


class PDReceiver:
    def __init__(
        self,
        tier: PDBuffer,
        *,
        fingerprint: str,
        host: str,
        port: int,
        alloc_timeout: float,
        attach: Attach,
        io_timeout: float = 30.0,
        idle_timeout: float = 300.0,
        max_connections: int = 64,
        auth_token: str | None = None,
        reservation_ttl: float = 120.0,
        expire: Expire | None = None,
    ) -> None:
        self.tier = tier
        self.fingerprint = fingerprint
        self.host = host
        self.port = port
        self.alloc_timeout = alloc_timeout
        self.io_timeout = io_timeout  # the handshake, and each message of a request
        self.idle_timeout = idle_timeout  # between requests
        self.auth_token = auth_token
        self.reservation_ttl = reservation_ttl
        self._attach = attach
        self._expire = expire
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self.guard = ConnectionGuard(
            max_connections=max_connections, handshake_timeout=io_timeout, on_tick=self._tick
        )
        self._next_sweep = 0.0
        self._busy: set[str] = set()  # requests whose transfer is in flight: never expired
        # Outcomes wait here until the decoder asks (wait_outcome); one it never asks for
        # (the request went away) must not stay forever, so only the newest are kept.
        self._outcomes: OrderedDict[str, TransferOutcome] = OrderedDict()
        self._cond = threading.Condition()
        self._closed = False
        self.protocol_errors = 0
        self.auth_failures = 0
        self.expired_reservations = 0
        self.timeouts = 0  # connections closed at a deadline
        for name in ("auth_failures", "timeouts", "protocol_errors", "expired_reservations"):
            tier.count_event(name, 0)  # in the tier's stats (and /metrics) from the start

    @classmethod
    def for_engine(
        cls, engine: HostsReceiver, *, host: str | None = None, port: int | None = None
    ) -> PDReceiver:
        """A receiver feeding ``engine``'s PD buffer, its reservations held in its leases."""
        return cls.for_host(engine.receiver_host(), host=host, port=port)

    @classmethod
    def for_host(
        cls, engine: ReceiverHost, *, host: str | None = None, port: int | None = None
    ) -> PDReceiver:
        """A receiver feeding ``engine``'s PD buffer, its reservations held in its leases."""
        cfg = engine.config
        buffer = engine.pd_buffer
        if buffer is None:
            raise StateError("this engine has no PD buffer (enable_pd with pd_role 'receiver')")
        ports = cfg.pd_peer_alloc_port or (0,)
        return cls(
            buffer,
            fingerprint=engine.fingerprint.hex(),
            host=host or cfg.pd_peer_host or "127.0.0.1",
            port=ports[0] if port is None else port,
            alloc_timeout=cfg.pd_allocation_timeout_sec,
            attach=engine.attach_hold,
            io_timeout=cfg.pd_message_timeout_sec,
            idle_timeout=cfg.pd_idle_timeout_sec,
            max_connections=cfg.pd_max_connections,
            auth_token=cfg.pd_auth_token,
            reservation_ttl=cfg.pd_reservation_ttl_sec,
            expire=engine.expire_unclaimed,
        )

    # -- lifecycle -------------------------------------------------------------------------
    def open(self) -> PDReceiver:
        """Listen and serve. Raises ConfigError, before binding anything, when the host is
        beyond loopback and there is no ``pd_auth_token``."""
        check_listen(self.host, self.auth_token)
        listener = socket.create_server((self.host, self.port), reuse_port=False)
        self.port = listener.getsockname()[1]
        self._listener = listener
        self.guard.open()
        self._spawn(self._accept_loop, "kvtier-pd-accept")
        log.info(
            "PD receiver listening on %s:%d (%s, %s)",
            self.host,
            self.port,
            self.tier.channel.name,
            "peers must prove pd_auth_token" if self.auth_token else "loopback, no token",
        )
        return self

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        if self._listener is not None:
            # close() alone does not wake a thread blocked in accept(); shutdown() does.
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
        self.guard.close()  # shuts every connection down: their threads end
        for thread in self._threads:
            thread.join(timeout=10.0)

    def __enter__(self) -> PDReceiver:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _spawn(self, target: Callable[..., None], name: str, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    # -- outcomes --------------------------------------------------------------------------
    def wait_outcome(self, request_id: str, timeout: float) -> TransferOutcome | None:
        """The outcome of ``request_id``'s transfer (taken: asked once), or None on timeout."""
        with self._cond:
            if not self._cond.wait_for(
                lambda: request_id in self._outcomes or self._closed, timeout
            ):
                return None
            return self._outcomes.pop(request_id, None)

    def _record(self, request_id: str, outcome: TransferOutcome) -> None:
        self.tier.count_transfer(outcome.ok)
        with self._cond:
            self._busy.discard(request_id)
            self._outcomes[request_id] = outcome
            self._outcomes.move_to_end(request_id)
            while len(self._outcomes) > MAX_UNCOLLECTED_OUTCOMES:
                self._outcomes.popitem(last=False)
            self._cond.notify_all()

    # -- serving ---------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        assert self._listener is not None
        while True:
            try:
                conn, peer = self._listener.accept()
            except OSError:
                return  # closed
            with self._cond:
                if self._closed:
                    conn.close()
                    return
            state = self.guard.admit(conn, f"{peer[0]}:{peer[1]}")
            if state is None:
                continue  # refused: pd_max_connections are open
            self._threads = [t for t in self._threads if t.is_alive()]
            self._spawn(self._serve, f"kvtier-pd-conn-{peer[1]}", state)

    def _serve(self, state: Connection) -> None:
        conn = state.sock
        conn.settimeout(None)  # the watchdog bounds every wait (see _await)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        current: _InFlight | None = None
        try:
            self._handshake(state)
            while True:
                if current is None:
                    limit = self.idle_timeout
                    self._await(state, limit, f"idle for {limit:g}s between requests")
                else:
                    rid, limit = current.request.request_id, self.io_timeout
                    self._await(state, limit, f"request {rid!r}: no next message within {limit:g}s")
                msg = recv_message(conn)
                if msg is None:
                    if state.overdue:
                        raise TransferTimeout(state.overdue)
                    if current is not None:
                        raise TransferError("sender disconnected mid-request")
                    return
                current = self._handle(state, msg, current)
        except TransferError as exc:  # ProtocolError and AuthError are TransferErrors
            self._closed_on(state, current, exc)
        finally:
            self.guard.leave(state)
            conn.close()

    def _closed_on(self, state: Connection, current: _InFlight | None, exc: TransferError) -> None:
        if state.overdue:  # whatever the read saw, the cause is the deadline
            self.timeouts += 1
            self.tier.count_event("timeouts")
            log.warning("PD connection from %s closed: %s", state.peer, state.overdue)
            self._fail(current, state.overdue)
        elif isinstance(exc, AuthError):
            self.auth_failures += 1
            self.tier.count_event("auth_failures")
            log.warning("PD connection from %s refused: %s", state.peer, exc)
        elif isinstance(exc, ProtocolError):
            self.protocol_errors += 1
            self.tier.count_event("protocol_errors")
            log.error("PD connection from %s closed: %s", state.peer, exc)
            self._fail(current, f"protocol error: {exc}")
        else:
            log.warning("PD connection from %s closed: %s", state.peer, exc)
            self._fail(current, str(exc))

    # -- deadlines -------------------------------------------------------------------------
    def _await(self, state: Connection, seconds: float, overdue: str) -> None:
        self.guard.expect(state, seconds, overdue)

    def _tick(self) -> None:
        """Run by the guard's watchdog: the reservation sweep, a few times per TTL."""
        now = time.monotonic()
        if self._expire is not None and now >= self._next_sweep:
            self._next_sweep = now + min(1.0, self.reservation_ttl / 4)
            self._sweep_reservations()

    def _sweep_reservations(self) -> None:
        assert self._expire is not None
        with self._cond:
            busy = set(self._busy)
        try:
            expired = self._expire(self.reservation_ttl, busy)
        except KVTierError as exc:  # the engine is closing
            log.debug("PD reservation sweep skipped: %s", exc)
            return
        self.expired_reservations += len(expired)
        if expired:
            self.tier.count_event("expired_reservations", len(expired))
        for rid in expired:
            log.warning(
                "PD reservation for request %r freed: the decoder did not look it up within "
                "%gs (pd_reservation_ttl_sec)",
                rid,
                self.reservation_ttl,
            )

    # -- handshake -------------------------------------------------------------------------
    def _handshake(self, state: Connection) -> None:
        conn = state.sock
        hello = recv_message(conn)
        if not isinstance(hello, Hello):
            raise ProtocolError(f"expected Hello, got {type(hello).__name__}")
        if self.auth_token is not None:
            challenge_sender(conn, hello, self.auth_token)
        tier = self.tier
        if hello.fingerprint != self.fingerprint:
            raise ProtocolError(
                f"sender's model fingerprint {hello.fingerprint} is not ours ({self.fingerprint})"
            )
        if hello.page_bytes != tier.page_bytes or hello.token_bytes != tier.token_bytes:
            raise ProtocolError("sender's chunk layout differs from the receiver's")
        if hello.channel != tier.channel.name:
            raise ProtocolError(
                f"sender uses transport {hello.channel!r}, receiver {tier.channel.name!r}"
            )
        extra = tier.channel.greet(hello)
        send_message(conn, HelloReply(tier.num_pages, tier.page_bytes, **extra))

    # -- serving ---------------------------------------------------------------------------
    def _handle(
        self, state: Connection, msg: Message, current: _InFlight | None
    ) -> _InFlight | None:
        conn = state.sock
        if isinstance(msg, AllocRequest):
            if current is not None:
                raise ProtocolError(
                    f"AllocRequest {msg.request_id!r} while {current.request.request_id!r} is open"
                )
            return self._allocate(state, msg)
        if current is None or getattr(msg, "request_id", None) != current.request.request_id:
            raise ProtocolError(
                f"{type(msg).__name__} for a request that is not in flight on this connection"
            )
        if isinstance(msg, ChunkSent):
            self._receive(conn, msg, current)
            return current
        if isinstance(msg, RequestDone):
            if current.pending:
                raise ProtocolError(f"RequestDone with {len(current.pending)} chunks never sent")
            ok = not current.corrupt and not current.reservation.released
            if current.reservation.released:
                message = "the request ended before its transfer completed"
            else:
                message = "" if ok else f"chunks {current.corrupt} failed their checksum"
            self._record(
                msg.request_id,
                TransferOutcome(ok, message, current.chunks, current.held, current.nbytes),
            )
            send_message(conn, DoneReply(msg.request_id, ok, message))
            return None
        if isinstance(msg, Abort):
            self._fail(current, f"aborted by the sender: {msg.reason}")
            return None
        raise ProtocolError(f"unexpected {type(msg).__name__} from a sender")

    def _allocate(self, state: Connection, req: AllocRequest) -> _InFlight | None:
        conn = state.sock
        _validate(req, self.tier)
        rid = req.request_id
        self._await(state, math.inf, "")  # waiting for room is the receiver's wait
        try:
            reservation, held = self.tier.reserve(rid, req.keys, req.num_tokens, self.alloc_timeout)
        except (TransferTimeout, TooLarge) as exc:
            kind = "timeout" if isinstance(exc, TransferTimeout) else "too_large"
            log.warning("PD request %s refused: %s", rid, exc)
            self._record(rid, TransferOutcome(False, str(exc)))
            send_message(conn, ErrorReply(rid, kind, str(exc)))
            return None
        finally:  # the reply: the peer's to take
            limit = self.io_timeout
            self._await(state, limit, f"request {rid!r}: reply not taken within {limit:g}s")
        try:
            self._attach(rid, reservation)
        except StateError as exc:  # the decoder ended the request meanwhile: already released
            self._record(rid, TransferOutcome(False, str(exc)))
            send_message(conn, ErrorReply(rid, "rejected", str(exc)))
            return None
        position = {key: i for i, key in enumerate(req.keys)}
        pending = {position[key]: page for page, key in reservation.new.items()}
        positions = sorted(pending)
        inflight = _InFlight(req, reservation, pending, len(held))
        with self._cond:
            self._busy.add(rid)
        send_message(conn, AllocReply(rid, held, [pending[i] for i in positions]))
        return inflight

    def _receive(self, conn: socket.socket, msg: ChunkSent, current: _InFlight) -> None:
        page = current.pending.pop(msg.index, None)
        if page is None:
            raise ProtocolError(
                f"ChunkSent for position {msg.index}, which was not reserved or already sent"
            )
        expected = self.tier.payload_bytes(current.request.num_tokens[msg.index])
        if msg.nbytes != expected:
            raise ProtocolError(
                f"chunk {msg.index} is {msg.nbytes} bytes; its {expected} were reserved"
            )
        conn.settimeout(self.io_timeout)
        try:
            view = self.tier.page_view(page, expected)
            sent, landed = self.tier.channel.receive_chunk(conn, view, msg)
        finally:
            conn.settimeout(None)
        if self.tier.publish(current.reservation, page, sent, landed):
            current.chunks += 1
            current.nbytes += expected
        else:
            current.corrupt.append(msg.index)

    def _fail(self, current: _InFlight | None, reason: str) -> None:
        if current is None:
            return
        current.reservation.release()
        self._record(
            current.request.request_id,
            TransferOutcome(False, reason, current.chunks, current.held, current.nbytes),
        )


def _validate(req: AllocRequest, tier: PDBuffer) -> None:
    max_tokens = tier.max_tokens
    if not req.request_id or len(req.request_id) > 512:
        raise ProtocolError("request_id must be 1..512 characters")
    if len(req.keys) != len(req.num_tokens) or not req.keys:
        raise ProtocolError("AllocRequest needs as many token counts as keys, at least one")
    if len(set(req.keys)) != len(req.keys):
        raise ProtocolError("AllocRequest repeats a key")
    for key, tokens in zip(req.keys, req.num_tokens, strict=True):
        _check_key(key)
        if not 1 <= tokens <= max_tokens:
            raise ProtocolError(f"a chunk of {tokens} tokens; the allowed range is 1..{max_tokens}")


def _check_key(key: ChunkKey) -> None:
    if len(key) != 16:
        raise ProtocolError(f"chunk keys are 16 bytes, got {len(key)}")
