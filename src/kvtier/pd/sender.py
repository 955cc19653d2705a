"""The prefiller side: sends a request's KV chunks into a decoder's receive buffer.

``send`` runs one request over the connection (see :mod:`kvtier.pd.protocol`): ask for
room for every chunk key, skip the keys the decoder already holds, move the others straight
into the pages it named, then say done. A decoder whose buffer stays full past
``pd_allocation_timeout_sec`` answers with a timeout, raised here as :class:`TransferTimeout`;
a request bigger than the whole buffer raises :class:`TransferError` at once. After a
transport failure the connection is closed; the next ``send`` reconnects, as it does when the
receiver closed an idle connection (``pd_idle_timeout_sec``).

Every connection opens with kvtier's handshake (:mod:`kvtier.trust`, protocol ``pd-push``):
with ``pd_auth_token`` the sender proves it knows the token and requires the receiver to
prove it too, before any KV moves: a receiver that cannot is refused with
:class:`AuthError`. Without a token, a receiver that asks for one is refused the same way.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import select
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from kvtier.config import Config
from kvtier.errors import ConfigError, ProtocolError, TransferError, TransferTimeout
from kvtier.keys import ChunkKey, ChunkSpan
from kvtier.layout import KVLayout
from kvtier.memory.device import CopyEngine, DeviceCopies, Direction
from kvtier.pd.channels import sender_channel
from kvtier.pd.channels.base import SenderChannel
from kvtier.pd.protocol import (
    PUSH,
    Abort,
    AllocReply,
    AllocRequest,
    DoneReply,
    ErrorReply,
    Hello,
    HelloReply,
    Message,
    RequestDone,
    recv_message,
    send_message,
)
from kvtier.trust.dial import connect
from kvtier.trust.handshake import Credentials
from kvtier.trust.peer_text import peer_text

log = logging.getLogger(__name__)

_M = TypeVar("_M", bound=Message)


@dataclass(frozen=True, slots=True)
class OutChunk:
    """One chunk to send: its key, token count and KV (any shape; canonical byte order)."""

    key: ChunkKey
    num_tokens: int
    data: torch.Tensor


@dataclass(frozen=True, slots=True)
class SendReport:
    sent: int  # chunks moved
    held: int  # chunks the decoder already had (not sent)
    nbytes: int
    seconds: float  # the whole request, waiting for room included
    alloc_s: float  # of which waiting for the AllocReply (room in the decoder's buffer)


def chunks_from_kv(spans: Sequence[ChunkSpan], kv: torch.Tensor, base: int = 0) -> list[OutChunk]:
    """Chunks of a ``[2, layers, tokens, hidden]`` KV tensor whose row 0 is token ``base``
    (strided views, no copy)."""
    return [
        OutChunk(s.key, s.num_tokens, kv[:, :, s.start - base : s.end - base, :]) for s in spans
    ]


class PDSender:
    def __init__(
        self,
        *,
        fingerprint: str,
        layout: KVLayout,
        chunk_size: int,
        host: str,
        port: int,
        channel: str | None,
        alloc_timeout: float,
        io_timeout: float = 30.0,
        auth_token: str | None = None,
        copies: CopyEngine | None = None,
    ) -> None:
        """``copies``: the owner of copies out of device memory (chunks given as device
        tensors are copied to the host before they are sent)."""
        self.fingerprint = fingerprint
        self.layout = layout
        self.page_bytes = layout.chunk_bytes(chunk_size)
        self.host = host
        self.port = port
        self.channel_name = channel
        self.alloc_timeout = alloc_timeout
        self.io_timeout = io_timeout
        self.auth_token = auth_token
        self.identity = f"pd-sender/{secrets.token_hex(4)}"
        self._sock: socket.socket | None = None
        self._channel: SenderChannel | None = None
        self.buffer_pages = 0
        self._in_step = False
        self._copies = copies if copies is not None else DeviceCopies()

    @classmethod
    def from_config(
        cls, config: Config, layout: KVLayout, fingerprint: str, *, tp_rank: int = 0
    ) -> PDSender:
        ports = config.pd_peer_alloc_port
        if not ports:
            raise ConfigError("pd_peer_alloc_port", ports, "the decoder's port (one per TP rank)")
        if tp_rank >= len(ports) and len(ports) != 1:
            raise ConfigError("pd_peer_alloc_port", ports, f"a port for TP rank {tp_rank}")
        return cls(
            fingerprint=fingerprint,
            layout=layout,
            chunk_size=config.chunk_size,
            host=config.pd_peer_host or "127.0.0.1",
            port=ports[tp_rank] if len(ports) > 1 else ports[0],
            channel=config.transfer_channel,
            alloc_timeout=config.pd_allocation_timeout_sec,
            io_timeout=config.pd_message_timeout_sec,
            auth_token=config.pd_auth_token,
        )

    # -- lifecycle -------------------------------------------------------------------------
    def open(self) -> PDSender:
        if self._sock is not None and _closed_by_peer(self._sock):
            self.close()  # the receiver dropped an idle connection: start a fresh one
        if self._sock is not None:
            return self
        where = f"the PD receiver at {self.host}:{self.port}"
        me = Credentials(PUSH, self.identity, self.auth_token, "pd_auth_token")
        deadline = time.monotonic() + self.io_timeout
        sock, _ = connect(self.host, self.port, me, deadline, where)
        return self.adopt(sock, where)

    def adopt(self, sock: socket.socket, where: str) -> PDSender:
        """Greet the receiver on ``sock``, a connection whose handshake passed, and send over
        it from now on (pulled transfers: the decoder dialed, :mod:`kvtier.pd.source`).
        ``where`` names the receiver in errors. Closes ``sock`` when the greeting fails."""
        channel = sender_channel(self.channel_name)
        sock.settimeout(self.io_timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            hello = Hello(
                self.fingerprint,
                self.page_bytes,
                self.layout.token_bytes(),
                channel.name,
                **channel.hello_fields(),
            )
            send_message(sock, hello)
            reply = self._check_reply(recv_message(sock), HelloReply)
            channel.attach(reply)
        except BaseException:
            sock.close()
            channel.close()
            self._in_step = False
            raise
        self.buffer_pages = reply.num_pages
        self._sock, self._channel = sock, channel
        return self

    def close(self) -> None:
        sock, self._sock = self._sock, None
        channel, self._channel = self._channel, None
        if sock is not None:
            sock.close()
        if channel is not None:
            channel.close()

    def __enter__(self) -> PDSender:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- sending ---------------------------------------------------------------------------
    def _payload(self, chunk: OutChunk) -> torch.Tensor:
        """What goes on the wire for ``chunk``: its page bytes, in host memory. A chunk
        tensor of a layout with a trimmed KV-cache group is packed first (only the tokens the
        group keeps); one in device memory is copied to the host, landed before the channel
        reads and checksums it."""
        data = chunk.data
        on_device = self._copies.on_device(data)
        if data.dim() != 4 or not (self.layout.trims or on_device):
            return data
        packed = torch.empty(self.layout.payload_bytes(chunk.num_tokens), dtype=torch.uint8)
        batch = self._copies.begin(data, Direction.STORE)
        try:
            if self.layout.trims:
                self.layout.pack(data, packed, batch.copy)
            else:
                batch.copy(packed.view(data.dtype).view(data.shape), data)
        finally:
            batch.close().wait()
        return packed

    def send(
        self,
        request_id: str,
        chunks: Sequence[OutChunk],
        *,
        abort_after: int | None = None,
        tenant: str = "",
    ) -> SendReport:
        """Transfer ``chunks`` for ``request_id``. ``abort_after=k`` gives up after k chunks
        (what a request aborted mid-transfer does): the decoder releases its reservation.
        ``tenant``: the request's ``cache_salt`` ("" none), whose share of the decoder's
        buffer it takes under ``tenant_quotas``."""
        if not chunks:
            return SendReport(0, 0, 0, 0.0, 0.0)
        self.open()
        return self.transfer(request_id, chunks, abort_after=abort_after, tenant=tenant)

    def transfer(
        self,
        request_id: str,
        chunks: Sequence[OutChunk],
        *,
        abort_after: int | None = None,
        tenant: str = "",
    ) -> SendReport:
        """:meth:`send` over the connection as it is (never reconnects)."""
        sock, channel = self._sock, self._channel
        if sock is None or channel is None:
            raise TransferError(f"request {request_id!r}: the PD connection is closed")
        start = time.perf_counter()
        try:
            request = AllocRequest(
                request_id, [c.key for c in chunks], [c.num_tokens for c in chunks], tenant
            )
            send_message(sock, request)
            sock.settimeout(self.alloc_timeout + self.io_timeout)
            reply = self._expect(sock, AllocReply)
            allocated = time.perf_counter()
            sock.settimeout(self.io_timeout)
            held = set(reply.held)
            todo = [i for i in range(len(chunks)) if i not in held]
            if len(todo) != len(reply.pages):
                raise ProtocolError(
                    f"AllocReply has {len(reply.pages)} pages for {len(todo)} chunks"
                )
            nbytes = 0
            for n, (i, page) in enumerate(zip(todo, reply.pages, strict=True)):
                if abort_after is not None and n >= abort_after:
                    send_message(sock, Abort(request_id, "aborted by the prefiller"))
                    self._in_step = True
                    raise TransferError(f"request {request_id!r} aborted after {n} chunks")
                nbytes += channel.send_chunk(sock, request_id, i, page, self._payload(chunks[i]))
            send_message(sock, RequestDone(request_id))
            done = self._expect(sock, DoneReply)
            if not done.ok:
                self._in_step = True
                raise TransferError(
                    f"decoder rejected request {request_id!r}: {peer_text(done.message)}"
                )
            end = time.perf_counter()
            return SendReport(len(todo), len(held), nbytes, end - start, allocated - start)
        except TransferError:
            # After a refusal, an abort or a rejected Done the stream is still in step; after
            # anything else it may not be: start over on the next send.
            if not self._in_step:
                self.close()
            raise
        finally:
            self._in_step = False

    def _expect(self, sock: socket.socket, kind: type[_M]) -> _M:
        return self._check_reply(recv_message(sock), kind)

    def _check_reply(self, msg: Message | None, kind: type[_M]) -> _M:
        if isinstance(msg, kind):
            return msg
        if isinstance(msg, ErrorReply):
            self._in_step = True
            error = TransferTimeout if msg.kind == "timeout" else TransferError
            rid, said = peer_text(msg.request_id), peer_text(msg.message)
            raise error(f"decoder refused request {rid} ({peer_text(msg.kind)}): {said}")
        if msg is None:
            raise TransferError("the PD receiver closed the connection")
        raise ProtocolError(f"expected {kind.__name__}, got {type(msg).__name__}")


def _closed_by_peer(sock: socket.socket) -> bool:
    """True when the peer has closed ``sock`` (readable at once, and nothing to read)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        if not readable:
            return False
        with contextlib.suppress(BlockingIOError):
            return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        return False
    except (OSError, ValueError):
        return True
