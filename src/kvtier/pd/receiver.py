"""The decoder side: serves senders, filling the PD tier's receive buffer.

One thread accepts connections; one thread per connection runs the receiver's half of the
protocol of :mod:`kvtier.pd.protocol` for that sender's requests, one at a time
(:mod:`kvtier.pd.conversation`: reserve every chunk of a request into its lease, receive and
verify each, record how the transfer ended). The decoder learns each request's outcome with
:meth:`PDReceiver.wait_outcome` (:mod:`kvtier.pd.outcomes`).

What a peer must do before any of that, and what bounds it (docs/security.md):

* pass kvtier's handshake (:mod:`kvtier.trust`, protocol ``pd-push``), proving it knows
  ``pd_auth_token``; without a token the receiver refuses to listen beyond loopback;
* at most ``pd_max_connections`` connections at once, and a quarter of them (at least 4)
  not yet authenticated: more are closed as they arrive;
* a deadline per wait (:mod:`kvtier.trust.guard`: its watchdog shuts the socket down past it):
  the whole handshake and each message of a request within ``pd_message_timeout_sec``, the
  next request within ``pd_idle_timeout_sec``;
* a request the decoder has not looked up ``pd_reservation_ttl_sec`` after its reservation
  arrived is ended from the same watchdog (``expire_unclaimed``): its pages go back, once.

Threads start in :meth:`open` and stop in :meth:`close`.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Collection
from typing import Protocol

from kvtier.config import Config
from kvtier.errors import KVTierError, StateError, TransferError, TransferTimeout
from kvtier.fingerprint import Fingerprint
from kvtier.lease import Hold
from kvtier.pd.buffer import PDBuffer
from kvtier.pd.conversation import Attach, ReceiverConversation, RequestInFlight
from kvtier.pd.outcomes import TransferOutcome, TransferOutcomes
from kvtier.pd.protocol import PUSH, recv_message
from kvtier.trust.guard import Connection, ConnectionGuard
from kvtier.trust.handshake import Credentials
from kvtier.trust.loopback import check_listen
from kvtier.trust.port import TrustedPort

log = logging.getLogger(__name__)

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


class PDReceiver:
    """Listens for PD senders and serves each connection; see the module docstring."""

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
        self._expire = expire
        self.identity = f"pd-receiver/{secrets.token_hex(4)}"
        self.guard = ConnectionGuard(
            max_connections=max_connections, handshake_timeout=io_timeout, on_tick=self._tick
        )
        self._next_sweep = 0.0
        self.outcomes = TransferOutcomes()
        self.conversation = ReceiverConversation(
            tier,
            fingerprint=fingerprint,
            alloc_timeout=alloc_timeout,
            io_timeout=io_timeout,
            attach=attach,
            guard=self.guard,
            outcomes=self.outcomes,
        )
        self._port = TrustedPort(
            name="PD receiver",
            host=host,
            port=port,
            credentials=Credentials(PUSH, self.identity, auth_token, "pd_auth_token"),
            guard=self.guard,
            serve=self._serve,
            logger=log,
            on_refused=self.conversation.handshake_refused,
        )
        self.expired_reservations = 0
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
        self._port.open()
        self.port = self._port.port
        log.info(
            "PD receiver listening on %s:%d (%s, %s)",
            self.host,
            self.port,
            self.tier.channel.name,
            "peers must prove pd_auth_token" if self.auth_token else "loopback, no token",
        )
        return self

    def close(self) -> None:
        self.outcomes.close()  # wakes every wait_outcome
        self._port.close()  # idempotent; shuts every connection down: their threads end

    @property
    def threads(self) -> int:
        """Threads serving this receiver's port now (its accept loop's included)."""
        return self._port.threads

    def __enter__(self) -> PDReceiver:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- outcomes and counters ------------------------------------------------------------
    def wait_outcome(self, request_id: str, timeout: float) -> TransferOutcome | None:
        """The outcome of ``request_id``'s transfer (taken: asked once), or None on timeout."""
        return self.outcomes.wait(request_id, timeout)

    @property
    def protocol_errors(self) -> int:
        """Connections closed on a malformed, oversized or out-of-order frame."""
        return self.conversation.protocol_errors

    @property
    def auth_failures(self) -> int:
        """Peers refused at the handshake."""
        return self.conversation.auth_failures

    @property
    def timeouts(self) -> int:
        """Connections closed at a deadline."""
        return self.conversation.timeouts

    # -- serving ---------------------------------------------------------------------------
    def _serve(self, state: Connection, peer: str) -> None:
        """One authenticated sender's connection (the port closes it when this returns)."""
        conn = state.sock
        conversation = self.conversation
        current: RequestInFlight | None = None
        try:
            self.guard.expect(state, self.io_timeout, "no PD Hello after the handshake")
            conversation.greet(state)
            while True:
                if current is None:
                    limit = self.idle_timeout
                    self.guard.expect(state, limit, f"idle for {limit:g}s between requests")
                else:
                    rid, limit = current.request.request_id, self.io_timeout
                    overdue = f"request {rid!r}: no next message within {limit:g}s"
                    self.guard.expect(state, limit, overdue)
                msg = recv_message(conn)
                if msg is None:
                    if state.overdue:
                        raise TransferTimeout(state.overdue)
                    if current is not None:
                        raise TransferError("sender disconnected mid-request")
                    return
                current = conversation.handle(state, msg, current)
        except TransferError as exc:  # ProtocolError and AuthError are TransferErrors
            conversation.connection_failed(state, current, exc)

    # -- the reservation sweep -------------------------------------------------------------
    def _tick(self) -> None:
        """Run by the guard's watchdog: the reservation sweep, a few times per TTL."""
        now = time.monotonic()
        if self._expire is not None and now >= self._next_sweep:
            self._next_sweep = now + min(1.0, self.reservation_ttl / 4)
            self._sweep_reservations()

    def _sweep_reservations(self) -> None:
        assert self._expire is not None
        busy = self.outcomes.in_flight()
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
