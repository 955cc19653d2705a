"""TCP transport: chunk payloads follow their ChunkSent header on the control socket.

The receiver reads each payload with ``recv_into`` straight into the page (a memoryview of
the pool's memory): no intermediate buffer on the receiving side. The sender sends a
contiguous tensor's memory as is (one copy only when the chunk is a strided view of a bigger
KV tensor).
"""

from __future__ import annotations

import socket

import torch

from kvtier.errors import TransferError, TransferTimeout
from kvtier.memory.block_pool import BlockPool
from kvtier.transfer.channel import ReceiverChannel, SenderChannel, checksum
from kvtier.transfer.protocol import ChunkSent, HelloReply, recv_exact, send_message


class TcpReceiver(ReceiverChannel):
    name = "tcp"

    def make_pool(self, num_pages: int, page_bytes: int) -> BlockPool:
        return BlockPool(num_pages, page_bytes)

    def receive_chunk(self, sock: socket.socket, page_view: torch.Tensor) -> None:
        recv_exact(sock, page_view.numpy().data.cast("B"))


class TcpSender(SenderChannel):
    name = "tcp"

    def attach(self, reply: HelloReply) -> None:
        return None

    def send_chunk(
        self, sock: socket.socket, request_id: str, index: int, page: int, data: torch.Tensor
    ) -> int:
        flat = data.contiguous().view(-1).view(torch.uint8)
        nbytes = flat.numel()
        send_message(sock, ChunkSent(request_id, index, nbytes, checksum(flat)))
        try:
            sock.sendall(flat.numpy().data.cast("B"))
        except TimeoutError:
            raise TransferTimeout("receiver stopped reading chunk payloads") from None
        except OSError as exc:
            raise TransferError(f"connection lost while sending a chunk: {exc}") from None
        return nbytes
