"""TCP transport: chunk payloads follow their ChunkSent header on the control socket.

On the wire, per chunk: the ChunkSent frame (its checksum field 0), ``nbytes`` of payload,
then the payload's checksum (:mod:`kvtier.pd.checksum`) as 8 big-endian bytes. The checksum
trails the payload so that both sides hash slice by slice as the bytes pass: the sender
hashes slice i+1 while the receiver takes in slice i, instead of two whole-chunk hashing
passes in series.

The receiver reads each slice with ``recv_into`` straight into the page (a memoryview of the
pool's memory, no intermediate buffer) and hashes it while it is still in cache. The sender
sends a contiguous tensor's memory as is (one copy only when the chunk is a strided view of
a bigger KV tensor).
"""

from __future__ import annotations

import socket

import torch

from kvtier.errors import TransferError, TransferTimeout
from kvtier.memory.block_pool import BlockPool
from kvtier.pd.channels.base import ReceiverChannel, SenderChannel
from kvtier.pd.checksum import BLOCK_BYTES, BlockHasher
from kvtier.pd.protocol import ChunkSent, HelloReply, recv_exact, send_message

SLICE_BYTES = BLOCK_BYTES  # hashed while cache-warm; large enough that per-slice calls are noise


class TcpReceiver(ReceiverChannel):
    name = "tcp"

    def make_pool(self, num_pages: int, page_bytes: int) -> BlockPool:
        return BlockPool(num_pages, page_bytes)

    def receive_chunk(
        self, sock: socket.socket, page_view: torch.Tensor, msg: ChunkSent
    ) -> tuple[int, int | None]:
        view = page_view.numpy().data.cast("B")
        hasher = BlockHasher()
        for start in range(0, len(view), SLICE_BYTES):
            piece = view[start : start + SLICE_BYTES]
            recv_exact(sock, piece)
            hasher.update(piece)
        trailer = bytearray(8)
        recv_exact(sock, memoryview(trailer))
        return int.from_bytes(trailer, "big"), hasher.intdigest()


class TcpSender(SenderChannel):
    name = "tcp"

    def attach(self, reply: HelloReply) -> None:
        return None

    def send_chunk(
        self, sock: socket.socket, request_id: str, index: int, page: int, data: torch.Tensor
    ) -> int:
        flat = data.contiguous().view(-1).view(torch.uint8)
        view = flat.numpy().data.cast("B")
        send_message(sock, ChunkSent(request_id, index, len(view), 0))
        hasher = BlockHasher()
        try:
            for start in range(0, len(view), SLICE_BYTES):
                piece = view[start : start + SLICE_BYTES]
                hasher.update(piece)
                sock.sendall(piece)
            sock.sendall(hasher.intdigest().to_bytes(8, "big"))
        except TimeoutError:
            raise TransferTimeout("receiver stopped reading chunk payloads") from None
        except OSError as exc:
            raise TransferError(f"connection lost while sending a chunk: {exc}") from None
        return len(view)
