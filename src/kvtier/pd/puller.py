"""The decoder side of a pulled transfer (xPyD): dial the prefiller a request names, claim its
transfer, receive it into the PD receive buffer.

The conversation is the receiver's own (:mod:`kvtier.pd.conversation`), after kvtier's
handshake (:mod:`kvtier.trust`, protocol ``pd-pull``, the decoder as the dialer): the same
reservation into the transfer id's lease, the same checksum per chunk, on a connection
the decoder dialed instead of accepted (see :mod:`kvtier.pd.source` for the prefiller's end).
Whatever goes wrong (the prefiller unreachable, dead mid-transfer, refusing the claim, a bad
chunk) ends in a failed :class:`~kvtier.pd.outcomes.TransferOutcome`, with everything the
transfer reserved given back: the decoder then prefills what it did not receive. Every wait
has a deadline (the receiver's watchdog), so a pull never hangs.

Connections are kept per prefiller address and reused, one pull at a time each.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import threading
import time
from collections.abc import Sequence

import msgspec

from kvtier.errors import AuthError, ProtocolError, TransferError
from kvtier.keys import ChunkKey
from kvtier.pd.conversation import RequestInFlight
from kvtier.pd.outcomes import TransferOutcome
from kvtier.pd.protocol import PULL, AllocRequest, ErrorReply, Pull, recv_message, send_message
from kvtier.pd.receiver import PDReceiver
from kvtier.pd.source import dialed_the_source
from kvtier.trust.dial import connect
from kvtier.trust.guard import Connection
from kvtier.trust.handshake import Credentials
from kvtier.trust.peer_text import peer_text

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0  # reaching an address and its handshake: else the decoder prefills
MAX_IDLE_PER_PEER = 4


class Puller:
    def __init__(self, receiver: PDReceiver) -> None:
        self.receiver = receiver
        self._idle: dict[tuple[str, int], list[Connection]] = {}
        self._lock = threading.Lock()
        self.pulls = 0
        self.failures = 0

    def pull(
        self, host: str, port: int, transfer_id: str, keys: Sequence[ChunkKey], tenant: str = ""
    ) -> TransferOutcome:
        """Claim ``transfer_id`` from the prefiller at ``host:port`` for a prompt of chunk
        ``keys`` and receive it; the reservation joins ``transfer_id``'s lease and counts
        against ``tenant``'s share (the decoder's own request's ``cache_salt``: whatever
        tenant the prefiller names is replaced, as its keys are checked against ours)."""
        self.pulls += 1
        try:
            state = self._connection(host, port)
        except TransferError as exc:
            self.failures += 1
            log.warning("PD pull of %r from %s:%d: %s", transfer_id, host, port, exc)
            return TransferOutcome(False, str(exc))
        receiver = self.receiver
        current: RequestInFlight | None = None
        try:
            send_message(state.sock, Pull(transfer_id, list(keys)))
            while True:
                limit = receiver.io_timeout
                receiver.guard.expect(state, limit, f"pull {transfer_id!r}: silent {limit:g}s")
                msg = recv_message(state.sock)
                if msg is None:
                    raise TransferError("the prefiller closed the connection")
                if isinstance(msg, ErrorReply) and current is None:
                    outcome = TransferOutcome(
                        False,
                        f"prefiller refused ({peer_text(msg.kind)}): {peer_text(msg.message)}",
                    )
                    break
                if isinstance(msg, AllocRequest):
                    _check_claim(msg, transfer_id, keys)
                    msg = msgspec.structs.replace(msg, tenant=tenant)
                current = receiver.conversation.handle(state, msg, current)
                if current is None:  # DoneReply sent, or the request refused or aborted
                    taken = receiver.wait_outcome(transfer_id, 0)
                    outcome = taken or TransferOutcome(False, "no outcome recorded")
                    break
        except TransferError as exc:
            error = TransferError(state.overdue) if state.overdue else exc
            receiver.conversation.connection_failed(state, current, error)
            receiver.wait_outcome(transfer_id, 0)  # taken here: nobody else asks
            self._drop(state)
            self.failures += 1
            return TransferOutcome(False, str(error))
        if not outcome.ok:
            self.failures += 1
        self._keep(host, port, state)
        return outcome

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for state in conns:
                self._drop(state)

    # -- connections -----------------------------------------------------------------------
    def _connection(self, host: str, port: int) -> Connection:
        with self._lock:
            conns = self._idle.get((host, port), [])
            while conns:
                state = conns.pop()
                if not state.overdue and not _readable(state.sock):
                    return state
                self._drop(state)  # closed by the prefiller (idle) or by our watchdog
        return self._dial(host, port)

    def _dial(self, host: str, port: int) -> Connection:
        receiver = self.receiver
        where = f"the PD prefiller at {host}:{port}"
        me = Credentials(PULL, receiver.identity, receiver.auth_token, "pd_auth_token")
        deadline = time.monotonic() + min(CONNECT_TIMEOUT_S, receiver.io_timeout)
        try:
            sock, identity = connect(host, port, me, deadline, where)
            if not dialed_the_source(identity, host, port):
                sock.close()
                raise AuthError(
                    f"{where} introduced itself as {peer_text(identity)}: not the PD source "
                    "at the address the request named (a relay of another source's handshake?)"
                )
        except TransferError as exc:
            receiver.conversation.handshake_refused(None, exc)
            raise
        state = receiver.guard.admit(sock, f"{host}:{port}")
        if state is None:
            raise TransferError("pd_max_connections are open; not pulling")
        receiver.guard.authenticated(state)
        try:
            receiver.guard.expect(state, receiver.io_timeout, "no PD Hello from the prefiller")
            receiver.conversation.greet(state)
        except TransferError as exc:
            error = TransferError(state.overdue) if state.overdue else exc
            receiver.conversation.connection_failed(state, None, error)
            self._drop(state)
            raise
        return state

    def _keep(self, host: str, port: int, state: Connection) -> None:
        idle = self.receiver.idle_timeout
        self.receiver.guard.expect(state, idle, f"pull connection idle for {idle:g}s")
        with self._lock:
            conns = self._idle.setdefault((host, port), [])
            if len(conns) < MAX_IDLE_PER_PEER:
                conns.append(state)
                return
        self._drop(state)

    def _drop(self, state: Connection) -> None:
        self.receiver.guard.leave(state)
        with contextlib.suppress(OSError):
            state.sock.close()


def _check_claim(msg: AllocRequest, transfer_id: str, keys: Sequence[ChunkKey]) -> None:
    """The prefiller may only send what was claimed: this transfer, a prefix of our keys."""
    if msg.request_id != transfer_id or msg.keys != list(keys[: len(msg.keys)]):
        raise ProtocolError(f"the prefiller offered other chunks than transfer {transfer_id!r}'s")


def _readable(sock: socket.socket) -> bool:
    """An idle connection with something to read has been closed (or is out of step)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable)
    except (OSError, ValueError):
        return True
