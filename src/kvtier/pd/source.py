"""The prefiller side of a pulled transfer (xPyD): hold a request's chunks, serve them to the
decoder that comes for them.

Behind a router that picks a prefiller and a decoder per request (vllm-router in PD mode),
the prefiller answers before the decoder has the request, and nothing tells it which decoder
that will be. So it keeps the request's chunks in its :class:`~kvtier.pd.send_buffer.SendBuffer`
and answers its PD address with the transfer id (``kv_transfer_params``); the decoder dials
that address and claims the transfer::

    decoder (PDReceiver.pull)              prefiller (PDSource, listening on its PD port)
    connect                           ->   accept (at most pd_max_connections)
    kvtier.trust handshake ("pd-pull")<->  both prove pd_auth_token before any PD frame; the
                                           prefiller's proof is a listener's, so it opens no
                                           receiver's port (which wants a dialer's)
                                      <-   Hello (the sender's greeting) ... HelloReply
    Pull(transfer id, its chunk keys) ->   claim: known, unclaimed, keys match (else ErrorReply)
                                      <-   AllocRequest(transfer id, held keys) ... DoneReply:
                                           today's push conversation, same transports
                                           the transfer ends (single use), its pages go back

The connection stays open for the next pull of the same decoder worker. Deadlines as on the
receiver (:class:`~kvtier.trust.guard.ConnectionGuard`): the handshake and each message within
``pd_message_timeout_sec``, the next Pull within ``pd_idle_timeout_sec``; its watchdog also
frees transfers no decoder claimed within ``pd_reservation_ttl_sec`` of their last chunk.
"""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import Callable, Sequence

import torch

from kvtier.config import Config
from kvtier.errors import AuthError, ConfigError, ProtocolError, TransferError
from kvtier.keys import ChunkSpan
from kvtier.layout import KVLayout
from kvtier.memory.block_pool import pages_for_capacity
from kvtier.memory.device import CopyEngine, DeviceCopies, Direction
from kvtier.pd.protocol import PULL, ErrorReply, Pull, recv_message, send_message
from kvtier.pd.send_buffer import ClaimRefused, SendBuffer
from kvtier.pd.sender import OutChunk, PDSender
from kvtier.trust.guard import Connection, ConnectionGuard
from kvtier.trust.handshake import Credentials
from kvtier.trust.loopback import check_listen
from kvtier.trust.peer_text import peer_text
from kvtier.trust.port import TrustedPort

log = logging.getLogger(__name__)


def source_identity(host: str, port: int, instance: str) -> str:
    """A PD source's identity in the handshake: ``pd-source <host>:<port> <instance>``, the
    address it answers in ``kv_transfer_params`` first, bound into both proofs."""
    return f"pd-source {host}:{port} {instance}"


def dialed_the_source(identity: str, host: str, port: int) -> bool:
    """Whether a listener that introduced itself as ``identity`` is the source a decoder
    meant to reach at ``host:port``: the address a request names is the client's word, and
    a relay at another address shows the real source's identity, not its own."""
    parts = identity.split(" ")
    return len(parts) == 3 and parts[0] == "pd-source" and parts[1] == f"{host}:{port}"


class PDSource:
    def __init__(
        self,
        buffer: SendBuffer,
        sender: Callable[[], PDSender],
        *,
        layout: KVLayout,
        host: str,
        port: int,
        auth_token: str | None,
        io_timeout: float = 30.0,
        idle_timeout: float = 300.0,
        max_connections: int = 64,
        copies: CopyEngine | None = None,
    ) -> None:
        """``sender()``: a PDSender configured like the prefiller's (fingerprint, layout,
        transport, token), used on each accepted connection. ``copies``: the owner of the
        copies out of device memory into the send buffer."""
        self.buffer = buffer
        self.layout = layout
        self.host = host
        self.port = port
        self.auth_token = auth_token
        self.io_timeout = io_timeout
        self.idle_timeout = idle_timeout
        self._make_sender = sender
        self._copies = copies if copies is not None else DeviceCopies()
        self.guard = ConnectionGuard(
            max_connections=max_connections,
            handshake_timeout=io_timeout,
            on_tick=self._tick,
            logger=log,
        )
        self._id = secrets.token_hex(4)
        self._port = TrustedPort(
            name="PD source",
            host=host,
            port=port,
            credentials=self._credentials(),
            guard=self.guard,
            serve=self._serve,
            logger=log,
            on_refused=self._refused,
        )
        self.failures = 0  # pulls that failed after their claim (the decoder prefills)
        self.auth_failures = 0  # dialers refused at the handshake

    @classmethod
    def from_config(
        cls, config: Config, layout: KVLayout, fingerprint: str, *, tp_rank: int = 0
    ) -> PDSource:
        if config.pd_buffer_size is None:
            raise ConfigError(
                "pd_buffer_size",
                None,
                "a size in bytes for a PD sender that decoders pull from (no "
                "pd_peer_alloc_port): it holds each request's chunks until its decoder comes",
            )
        page_bytes = layout.chunk_bytes(config.chunk_size)
        pages = pages_for_capacity("pd_buffer_size", config.pd_buffer_size, page_bytes)
        buffer = SendBuffer(pages, page_bytes, ttl=config.pd_reservation_ttl_sec)
        ports = config.pd_serve_port or (0,)
        port = ports[tp_rank] if len(ports) > 1 else ports[0] + (tp_rank if ports[0] else 0)

        def sender() -> PDSender:
            return PDSender(
                fingerprint=fingerprint,
                layout=layout,
                chunk_size=config.chunk_size,
                host="",
                port=0,
                channel=config.transfer_channel,
                alloc_timeout=config.pd_allocation_timeout_sec,
                io_timeout=config.pd_message_timeout_sec,
                auth_token=config.pd_auth_token,
            )

        return cls(
            buffer,
            sender,
            layout=layout,
            host=config.pd_serve_host,
            port=port,
            auth_token=config.pd_auth_token,
            io_timeout=config.pd_message_timeout_sec,
            idle_timeout=config.pd_idle_timeout_sec,
            max_connections=config.pd_max_connections,
        )

    # -- lifecycle -------------------------------------------------------------------------
    def open(self) -> PDSource:
        """Listen (refused beyond loopback without ``pd_auth_token``) and serve pulls."""
        check_listen(self.host, self.auth_token)
        self.buffer.open()
        self._port.open()
        self.port = self._port.port
        # The address it answers in kv_transfer_params is now whole: from here every
        # handshake names it, and a decoder checks it is the address it dialed.
        self._port.credentials = self._credentials()
        log.info(
            "PD source listening on %s:%d (decoders pull; %d pages of send buffer)",
            self.host,
            self.port,
            self.buffer.num_pages,
        )
        return self

    @property
    def identity(self) -> str:
        """How this source introduces itself: the address decoders are told to dial."""
        return source_identity(self.host, self.port, self._id)

    def _credentials(self) -> Credentials:
        return Credentials(PULL, self.identity, self.auth_token, "pd_auth_token")

    def close(self) -> None:
        self._port.close()
        self.buffer.close()

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    # -- the prefiller's side --------------------------------------------------------------
    def hold(
        self, transfer_id: str, spans: Sequence[ChunkSpan], kv: torch.Tensor, base: int = 0
    ) -> int:
        """Copy ``spans`` of ``kv`` (``[2, layers, >=end - base, hidden]``, row 0: token
        ``base``) into the send buffer for ``transfer_id``; returns how many it holds now of
        them (fewer when it is full)."""
        layout = self.layout

        def write(i: int, page: torch.Tensor) -> None:
            span = spans[i]
            data = kv[:, :, span.start - base : span.end - base, :]  # strided: copied once
            out = page[: layout.payload_bytes(span.num_tokens)]
            batch = self._copies.begin(kv, Direction.STORE)
            try:
                if layout.trims:
                    layout.pack(data, out, batch.copy)
                else:
                    batch.copy(out.view(data.dtype).view(data.shape), data)
            finally:
                # Landed before the buffer publishes the key: a pull reads the page next.
                batch.close().wait()

        keys = [s.key for s in spans]
        return self.buffer.hold(transfer_id, keys, [s.num_tokens for s in spans], write)

    # -- serving ---------------------------------------------------------------------------
    def _tick(self) -> None:
        for transfer_id in self.buffer.expire():
            log.warning(
                "PD transfer %r freed: no decoder claimed it within %gs (pd_reservation_ttl_sec)",
                transfer_id,
                self.buffer.ttl,
            )

    def _refused(self, state: Connection, exc: TransferError) -> None:
        self.auth_failures += isinstance(exc, AuthError)

    def _serve(self, state: Connection, peer: str) -> None:
        """One authenticated decoder's connection (the port closes it when this returns)."""
        sender = self._make_sender()
        try:
            self.guard.expect(state, self.io_timeout, "no HelloReply from the decoder")
            sender.adopt(state.sock, f"the PD decoder at {state.peer}")
            while True:
                state.sock.settimeout(None)  # between pulls the guard's deadline bounds it
                self.guard.expect(state, self.idle_timeout, "no Pull within pd_idle_timeout_sec")
                msg = recv_message(state.sock)
                if msg is None:
                    return
                if not isinstance(msg, Pull):
                    raise ProtocolError(f"expected Pull, got {type(msg).__name__}")
                # Serving: the sender's own socket timeouts bound each of its waits.
                self.guard.expect(state, math.inf, "")
                state.sock.settimeout(self.io_timeout)
                self._serve_pull(sender, state, msg)
        except TransferError as exc:
            level = logging.DEBUG if state.overdue else logging.WARNING
            log.log(
                level, "PD pull connection from %s closed: %s", state.peer, state.overdue or exc
            )
        finally:
            sender.close()

    def _serve_pull(self, sender: PDSender, state: Connection, pull: Pull) -> None:
        try:
            transfer = self.buffer.claim(pull.request_id, pull.keys)
        except ClaimRefused as exc:
            rid = peer_text(pull.request_id)
            log.warning("PD pull of %s from %s refused: %s", rid, state.peer, exc)
            send_message(state.sock, ErrorReply(pull.request_id, exc.kind, str(exc)))
            return
        try:
            chunks = [
                OutChunk(
                    key,
                    tokens,
                    self.buffer.chunk_view(transfer, i, self.layout.payload_bytes(tokens)),
                )
                for i, (key, tokens) in enumerate(
                    zip(transfer.keys, transfer.num_tokens, strict=True)
                )
            ]
            if chunks:
                sender.transfer(pull.request_id, chunks)
            else:  # held nothing (a full buffer): say so, the decoder prefills
                send_message(
                    state.sock, ErrorReply(pull.request_id, "unknown", "no chunk was held")
                )
        except TransferError as exc:
            self.failures += 1
            rid = peer_text(pull.request_id)
            log.warning("PD pull of %s by %s failed: %s", rid, state.peer, exc)
            if sender._sock is None:  # the connection is gone: stop serving it
                raise
        finally:
            self.buffer.end(transfer)  # single use: served or failed, it is over
