"""NIXL transport: one-sided writes into the receiver's registered buffer, with notifications.

The receiver registers its whole receive buffer with a NIXL agent (DRAM, UCX backend) and
sends the agent's metadata and the buffer's base address in its HelloReply; the sender adds
that agent, registers one staging page of its own, and for each chunk:

1. copies the chunk into the staging page (the one copy on the sender side; NIXL moves only
   registered memory, and KV chunks are strided views of a bigger tensor),
2. posts a WRITE of those bytes to ``base_address + page * page_bytes`` with the notification
   ``"<request_id>\\0<index>"`` and waits for it to complete,
3. sends the ChunkSent header (with the checksum) on the control socket.

The receiver, on ChunkSent, waits for that chunk's notification (the bytes are in the page),
then the tier verifies the checksum and publishes. No receiver-side copy at all.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
import uuid
from typing import Any

import torch

from kvtier.errors import TransferError, TransferTimeout
from kvtier.memory.block_pool import BlockPool
from kvtier.pd.channels.base import ReceiverChannel, SenderChannel, checksum
from kvtier.pd.protocol import ChunkSent, Hello, HelloReply, send_message

log = logging.getLogger(__name__)

BACKENDS = ["UCX"]
POLL_S = 0.0002  # notification / completion polling interval
WAIT_S = 30.0  # longest wait for one chunk's write or notification


def _agent(role: str) -> Any:
    # nixl logs INFO lines to stdout by default, which would corrupt `--json` output; a value
    # the user set wins.
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ModuleNotFoundError:  # only the nixl-cu12 wheel, without the "nixl" meta-package
        from nixl_cu12._api import nixl_agent, nixl_agent_config

    name = f"kvtier-pd-{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        return nixl_agent(name, nixl_agent_config(backends=BACKENDS))
    except Exception as exc:  # nixl raises its own exception types
        raise TransferError(f"cannot start a NIXL agent: {exc}") from None


def tag(request_id: str, index: int) -> bytes:
    return f"{request_id}\0{index}".encode()


class NixlReceiver(ReceiverChannel):
    name = "nixl"

    def __init__(self) -> None:
        self._agent: Any = None
        self._base = 0
        self._seen: set[bytes] = set()  # notifications arrived, not yet claimed
        self._lock = threading.Lock()

    def make_pool(self, num_pages: int, page_bytes: int) -> BlockPool:
        pool = BlockPool(num_pages, page_bytes)
        self._agent = _agent("rx")
        try:
            self._agent.register_memory(pool.buffer)
        except Exception as exc:
            pool.close()
            raise TransferError(f"NIXL could not register the receive buffer: {exc}") from None
        self._base = pool.base_address
        return pool

    def greet(self, hello: Hello) -> dict[str, Any]:
        if hello.nixl_metadata:
            self._agent.add_remote_agent(hello.nixl_metadata)
        return {"nixl_metadata": self._agent.get_agent_metadata(), "base_address": self._base}

    def receive_chunk(
        self, sock: socket.socket, page_view: torch.Tensor, msg: ChunkSent
    ) -> tuple[int, int | None]:
        want = tag(msg.request_id, msg.index)
        deadline = time.monotonic() + WAIT_S
        while True:
            with self._lock:  # one poller at a time; others find their tags in _seen
                for messages in self._agent.get_new_notifs().values():
                    self._seen.update(messages)
                if want in self._seen:
                    self._seen.discard(want)
                    return msg.checksum, None
            if time.monotonic() > deadline:
                raise TransferTimeout(f"no NIXL notification for chunk {msg.index} in {WAIT_S}s")
            _check_alive(sock)
            time.sleep(POLL_S)

    def close(self) -> None:
        self._agent = None  # the agent deregisters and disconnects when collected


def _check_alive(sock: socket.socket) -> None:
    """Raise if the sender hung up while we wait for its write (a killed sender sends no
    notification; its closed socket is how we learn to release its reservation)."""
    readable, _, _ = select.select([sock], [], [], 0)
    if readable:
        try:
            gone = sock.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            gone = True
        if gone:
            raise TransferError("sender disconnected while its chunk was in flight")


class NixlSender(SenderChannel):
    name = "nixl"

    def __init__(self) -> None:
        self._agent: Any = _agent("tx")
        self._remote = ""
        self._base = 0
        self._page_bytes = 0
        self._staging: torch.Tensor | None = None
        self._local: Any = None

    def hello_fields(self) -> dict[str, Any]:
        return {"nixl_metadata": self._agent.get_agent_metadata()}

    def attach(self, reply: HelloReply) -> None:
        if not reply.nixl_metadata:
            raise TransferError("the receiver offered no NIXL agent metadata")
        remote = self._agent.add_remote_agent(reply.nixl_metadata)
        self._remote = remote.decode() if isinstance(remote, bytes) else str(remote)
        self._base = reply.base_address
        self._page_bytes = reply.page_bytes
        staging = torch.zeros(reply.page_bytes, dtype=torch.uint8)  # touched once, here
        self._agent.register_memory(staging)
        self._staging = staging

    def send_chunk(
        self, sock: socket.socket, request_id: str, index: int, page: int, data: torch.Tensor
    ) -> int:
        staging = self._staging
        assert staging is not None, "attach() first"
        nbytes = data.numel() * data.element_size()
        if nbytes > self._page_bytes:
            raise TransferError(
                f"chunk of {nbytes} bytes does not fit a {self._page_bytes}-byte page"
            )
        src = staging[:nbytes]
        if data.is_contiguous():
            src.copy_(data.view(-1).view(torch.uint8))
        else:
            src.view(data.dtype).view(data.shape).copy_(data)
        digest = checksum(src)
        self._write(src, self._base + page * self._page_bytes, tag(request_id, index))
        send_message(sock, ChunkSent(request_id, index, nbytes, digest))
        return nbytes

    def _write(self, src: torch.Tensor, remote_address: int, notif: bytes) -> None:
        agent = self._agent
        try:
            local = agent.get_xfer_descs([(src.data_ptr(), src.numel(), 0)], "DRAM")
            remote = agent.get_xfer_descs([(remote_address, src.numel(), 0)], "DRAM")
            handle = agent.initialize_xfer("WRITE", local, remote, self._remote, notif)
        except Exception as exc:
            raise TransferError(f"NIXL could not prepare a write: {exc}") from None
        try:
            state = agent.transfer(handle)
            deadline = time.monotonic() + WAIT_S
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TransferTimeout(f"NIXL write did not complete in {WAIT_S}s")
                time.sleep(POLL_S)  # leave the core to the receiver (2-core hosts)
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransferError(f"NIXL write failed ({state})")
        finally:
            agent.release_xfer_handle(handle)

    def close(self) -> None:
        if self._remote:
            try:
                self._agent.remove_remote_agent(self._remote)
            except Exception as exc:  # closing: nothing to do but say so
                log.debug("NIXL remove_remote_agent failed: %s", exc)
            self._remote = ""
        self._staging = None
