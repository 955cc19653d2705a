"""The prefiller side of a pulled transfer (xPyD): hold a request's chunks, serve them to the
decoder that comes for them.

Behind a router that picks a prefiller and a decoder per request (vllm-router in PD mode),
the prefiller answers before the decoder has the request, and nothing tells it which decoder
that will be. So it keeps the request's chunks in its :class:`~kvtier.pd.send_buffer.SendBuffer`
and answers its PD address with the transfer id (``kv_transfer_params``); the decoder dials
that address and claims the transfer::

    decoder (PDReceiver.pull)              prefiller (PDSource, listening on its PD port)
    connect                           ->   accept (at most pd_max_connections)
                                      <-   Hello(nonce): the sender's handshake (pd/auth.py)
    Challenge / Proof / HelloReply    <->  both prove pd_auth_token before any KV moves
    Pull(transfer id, its chunk keys) ->   claim: known, unclaimed, keys match (else ErrorReply)
                                      <-   AllocRequest(transfer id, held keys) ... DoneReply:
                                           today's push conversation, same transports
                                           the transfer ends (single use), its pages go back

The connection stays open for the next pull of the same decoder worker. Deadlines as on the
receiver (:class:`~kvtier.pd.guard.ConnectionGuard`): the handshake and each message within
``pd_message_timeout_sec``, the next Pull within ``pd_idle_timeout_sec``; its watchdog also
frees transfers no decoder claimed within ``pd_reservation_ttl_sec`` of their last chunk.
"""

from __future__ import annotations

import contextlib
import logging
import math
import socket
import threading
from collections.abc import Callable, Sequence

import torch

from kvtier.config import Config
from kvtier.errors import ConfigError, ProtocolError, TransferError
from kvtier.keys import ChunkSpan
from kvtier.layout import KVLayout
from kvtier.memory.block_pool import pages_for_capacity
from kvtier.memory.device import CopyEngine, DeviceCopies, Direction
from kvtier.pd.auth import check_listen
from kvtier.pd.guard import Connection, ConnectionGuard
from kvtier.pd.protocol import ErrorReply, Pull, recv_message, send_message
from kvtier.pd.send_buffer import ClaimRefused, SendBuffer
from kvtier.pd.sender import OutChunk, PDSender

log = logging.getLogger(__name__)


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
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self.guard = ConnectionGuard(
            max_connections=max_connections, handshake_timeout=io_timeout, on_tick=self._tick
        )
        self.failures = 0  # pulls that failed after their claim (the decoder prefills)

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
        listener = socket.create_server((self.host, self.port))
        self.port = listener.getsockname()[1]
        self._listener = listener
        self.guard.open()
        thread = threading.Thread(target=self._accept_loop, name="kvtier-pd-source", daemon=True)
        self._threads.append(thread)
        thread.start()
        log.info(
            "PD source listening on %s:%d (decoders pull; %d pages of send buffer)",
            self.host,
            self.port,
            self.buffer.num_pages,
        )
        return self

    def close(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        self.guard.close()
        for thread in self._threads:
            thread.join(timeout=10.0)
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

    def _accept_loop(self) -> None:
        listener = self._listener
        assert listener is not None
        while True:
            try:
                conn, peer = listener.accept()
            except OSError:
                return  # closed
            state = self.guard.admit(conn, f"{peer[0]}:{peer[1]}")
            if state is None:
                continue
            self._threads = [t for t in self._threads if t.is_alive()]
            thread = threading.Thread(
                target=self._serve, args=(state,), name=f"kvtier-pd-pull-{peer[1]}", daemon=True
            )
            self._threads.append(thread)
            thread.start()

    def _serve(self, state: Connection) -> None:
        sender = self._make_sender()
        try:
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
            self.guard.leave(state)
            sender.close()
            state.sock.close()

    def _serve_pull(self, sender: PDSender, state: Connection, pull: Pull) -> None:
        try:
            transfer = self.buffer.claim(pull.request_id, pull.keys)
        except ClaimRefused as exc:
            log.warning("PD pull of %r from %s refused: %s", pull.request_id, state.peer, exc)
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
            log.warning("PD pull of %r by %s failed: %s", pull.request_id, state.peer, exc)
            if sender._sock is None:  # the connection is gone: stop serving it
                raise
        finally:
            self.buffer.end(transfer)  # single use: served or failed, it is over
