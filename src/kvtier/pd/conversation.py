"""The receiver's half of the PD protocol (:mod:`kvtier.pd.protocol`) on one connection.

The same conversation runs on a connection the decoder accepted (:class:`PDReceiver`, pushed
transfers) and on one it dialed (:class:`~kvtier.pd.puller.Puller`, pulled transfers), each
only after kvtier's handshake (:mod:`kvtier.trust`) authenticated the peer. After the PD
greeting (:meth:`ReceiverConversation.greet`), per request:

1. ``AllocRequest``: the PD tier reserves every chunk at once (held keys take one reference
   for this request, nothing more) and the reservation goes into the decoder request's lease
   through ``attach(request_id, reservation)``: ``end_request`` gives it back, whichever way
   the request ends. A full buffer (or, with ``tenant_quotas``, a tenant at its share of it:
   :mod:`kvtier.pd.tenant_shares`) waits up to ``pd_allocation_timeout_sec``, then both
   sides get :class:`TransferTimeout` and the decoder prefills locally.
2. ``ChunkSent``: the payload lands in its page (tcp: ``recv_into`` the page), is verified and
   published: from then on the decoder's lookup finds it.
3. ``RequestDone`` / ``Abort`` / the connection dropping / a malformed frame: the outcome is
   recorded for the decoder (:class:`~kvtier.pd.outcomes.TransferOutcomes`); on every failure
   the reservation is released at once (the lease's later release is then a no-op).

The caller owns the connection and its read loop: it reads each message and passes it to
:meth:`ReceiverConversation.handle`, and when the connection ends on an error it calls
:meth:`ReceiverConversation.connection_failed`, which counts, logs and fails the request in
flight. Every wait here is bounded by the connection's deadline (:mod:`kvtier.trust.guard`).
"""

from __future__ import annotations

import logging
import math
import socket
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier.config.tenant_quotas import MAX_TENANT_CHARS
from kvtier.errors import AuthError, ProtocolError, StateError, TransferError, TransferTimeout
from kvtier.keys import ChunkKey
from kvtier.lease import Hold
from kvtier.pd.buffer import PDBuffer, TooLarge
from kvtier.pd.outcomes import TransferOutcome, TransferOutcomes
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
from kvtier.pd.tenant_shares import ShareTooSmall
from kvtier.trust.guard import Connection, ConnectionGuard
from kvtier.trust.peer_text import peer_text

# The receiver's logger, as the guard's: one name carries every line about its connections.
log = logging.getLogger("kvtier.pd.receiver")

Attach = Callable[[str, Hold], None]

# A reservation refused: the ErrorReply kind the sender sees (TransferTimeout for "timeout").
_ERROR_KINDS = {TransferTimeout: "timeout", TooLarge: "too_large", ShareTooSmall: "over_share"}


@dataclass
class RequestInFlight:
    """One request whose chunks are arriving on a connection."""

    request: AllocRequest
    reservation: Reservation
    pending: dict[int, int]  # key position -> page, for chunks not received yet
    held: int
    chunks: int = 0
    nbytes: int = 0
    corrupt: list[int] = field(default_factory=list)


class ReceiverConversation:
    """The receiver's protocol steps and their counters, shared by every connection of one
    decoder: see the module docstring."""

    def __init__(
        self,
        tier: PDBuffer,
        *,
        fingerprint: str,
        alloc_timeout: float,
        io_timeout: float,
        attach: Attach,
        guard: ConnectionGuard,
        outcomes: TransferOutcomes,
    ) -> None:
        self.tier = tier
        self.fingerprint = fingerprint
        self.alloc_timeout = alloc_timeout
        self.io_timeout = io_timeout  # the handshake, and each message of a request
        self.guard = guard
        self.outcomes = outcomes
        self._attach = attach
        self.protocol_errors = 0
        self.auth_failures = 0
        self.timeouts = 0  # connections closed at a deadline

    # -- greeting --------------------------------------------------------------------------
    def greet(self, state: Connection) -> None:
        """The sender's Hello (on a connection already authenticated), checked against this
        decoder's model and transport, answered with how to reach the buffer."""
        conn = state.sock
        hello = recv_message(conn)
        if not isinstance(hello, Hello):
            raise ProtocolError(f"expected Hello, got {type(hello).__name__}")
        tier = self.tier
        if hello.fingerprint != self.fingerprint:
            raise ProtocolError(
                f"sender's model fingerprint {peer_text(hello.fingerprint)} is not ours "
                f"({self.fingerprint})"
            )
        if hello.page_bytes != tier.page_bytes or hello.token_bytes != tier.token_bytes:
            raise ProtocolError("sender's chunk layout differs from the receiver's")
        if hello.channel != tier.channel.name:
            raise ProtocolError(
                f"sender uses transport {peer_text(hello.channel)}, receiver {tier.channel.name!r}"
            )
        extra = tier.channel.greet(hello)
        send_message(conn, HelloReply(tier.num_pages, tier.page_bytes, **extra))

    # -- requests --------------------------------------------------------------------------
    def handle(
        self, state: Connection, msg: Message, current: RequestInFlight | None
    ) -> RequestInFlight | None:
        """Act on one message from the sender; returns the request in flight after it."""
        conn = state.sock
        if isinstance(msg, AllocRequest):
            if current is not None:
                raise ProtocolError(
                    f"AllocRequest {peer_text(msg.request_id)} while "
                    f"{peer_text(current.request.request_id)} is open"
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

    def handshake_refused(self, state: Connection | None, exc: TransferError) -> None:
        """Count a handshake that failed, on a connection accepted (``state``; the port logs
        it, once per interval) or dialed (None; the puller logs it)."""
        if (state is not None and state.overdue) or isinstance(exc, TransferTimeout):
            self.timeouts += 1
            self.tier.count_event("timeouts")
        elif isinstance(exc, AuthError):
            self.auth_failures += 1
            self.tier.count_event("auth_failures")
        elif isinstance(exc, ProtocolError):
            self.protocol_errors += 1
            self.tier.count_event("protocol_errors")

    def connection_failed(
        self, state: Connection, current: RequestInFlight | None, exc: TransferError
    ) -> None:
        """The connection ends on ``exc``: count and log why, fail the request in flight."""
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

    def _allocate(self, state: Connection, req: AllocRequest) -> RequestInFlight | None:
        conn = state.sock
        _validate(req, self.tier)
        rid = req.request_id
        self.guard.expect(state, math.inf, "")  # waiting for room is the receiver's wait
        try:
            reservation, held = self.tier.reserve(
                rid, req.keys, req.num_tokens, self.alloc_timeout, req.tenant
            )
        except (TransferTimeout, TooLarge, ShareTooSmall) as exc:
            kind = _ERROR_KINDS[type(exc)]
            log.warning("PD request %s refused: %s", peer_text(rid), exc)
            self._record(rid, TransferOutcome(False, str(exc)))
            send_message(conn, ErrorReply(rid, kind, str(exc)))
            return None
        finally:  # the reply: the peer's to take
            limit = self.io_timeout
            self.guard.expect(state, limit, f"request {rid!r}: reply not taken within {limit:g}s")
        try:
            self._attach(rid, reservation)
        except StateError as exc:  # the decoder ended the request meanwhile: already released
            self._record(rid, TransferOutcome(False, str(exc)))
            send_message(conn, ErrorReply(rid, "rejected", str(exc)))
            return None
        position = {key: i for i, key in enumerate(req.keys)}
        pending = {position[key]: page for page, key in reservation.new.items()}
        positions = sorted(pending)
        inflight = RequestInFlight(req, reservation, pending, len(held))
        self.outcomes.begin(rid)
        send_message(conn, AllocReply(rid, held, [pending[i] for i in positions]))
        return inflight

    def _receive(self, conn: socket.socket, msg: ChunkSent, current: RequestInFlight) -> None:
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

    def _fail(self, current: RequestInFlight | None, reason: str) -> None:
        if current is None:
            return
        current.reservation.release()
        self._record(
            current.request.request_id,
            TransferOutcome(False, reason, current.chunks, current.held, current.nbytes),
        )

    def _record(self, request_id: str, outcome: TransferOutcome) -> None:
        self.tier.count_transfer(outcome.ok)
        self.outcomes.record(request_id, outcome)


def _validate(req: AllocRequest, tier: PDBuffer) -> None:
    max_tokens = tier.max_tokens
    if not req.request_id or len(req.request_id) > 512:
        raise ProtocolError("request_id must be 1..512 characters")
    if len(req.keys) != len(req.num_tokens) or not req.keys:
        raise ProtocolError("AllocRequest needs as many token counts as keys, at least one")
    if len(set(req.keys)) != len(req.keys):
        raise ProtocolError("AllocRequest repeats a key")
    if len(req.tenant) > MAX_TENANT_CHARS:
        raise ProtocolError(f"AllocRequest's tenant is over {MAX_TENANT_CHARS} characters")
    for key, tokens in zip(req.keys, req.num_tokens, strict=True):
        _check_key(key)
        if not 1 <= tokens <= max_tokens:
            raise ProtocolError(f"a chunk of {tokens} tokens; the allowed range is 1..{max_tokens}")


def _check_key(key: ChunkKey) -> None:
    if len(key) != 16:
        raise ProtocolError(f"chunk keys are 16 bytes, got {len(key)}")
