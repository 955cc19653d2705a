"""The PD data plane behind one small interface: how chunk bytes get into the receiver's pages.

The control messages (:mod:`kvtier.pd.protocol`) are the same on every transport; a
channel only decides

* on the receiver: what memory the receive buffer is (``make_pool``), what a sender needs to
  reach it (``greet``: extra HelloReply fields, such as the shm segment's name) and how a
  chunk's bytes land in its page (``receive_chunk``: read straight from the socket into the
  page, or nothing to do because the sender already wrote into shared memory);
* on the sender: how to reach that memory (``attach``) and how one chunk travels
  (``send_chunk``, which also computes the checksum the receiver verifies).

Transports, chosen by ``transfer_channel``: ``tcp`` (default; any host), ``shm`` (same host:
the buffer is a /dev/shm segment both processes map), ``nixl`` (one-sided writes into the
receiver's registered buffer through NIXL/UCX, when the ``nixl`` package is installed).
"""

from __future__ import annotations

import socket
from abc import ABC, abstractmethod
from typing import Any

import torch

from kvtier.memory.block_pool import BlockPool
from kvtier.pd.checksum import checksum as checksum  # the chunk checksum, for channels
from kvtier.pd.protocol import ChunkSent, Hello, HelloReply


class ReceiverChannel(ABC):
    name: str
    # True when the receiver does not hash a chunk at publish: the PD tier then verifies it
    # against the sender's checksum while copying it out at serve time (shm: the sender wrote
    # the page itself, so a publish-time hash would be a whole extra pass over it).
    verify_at_serve = False

    @abstractmethod
    def make_pool(self, num_pages: int, page_bytes: int) -> BlockPool:
        """The receive buffer's pool (called once, at the tier's open)."""

    def greet(self, hello: Hello) -> dict[str, Any]:
        """Take a sender's Hello; return the extra HelloReply fields it needs."""
        return {}

    @abstractmethod
    def receive_chunk(
        self, sock: socket.socket, page_view: torch.Tensor, msg: ChunkSent
    ) -> tuple[int, int | None]:
        """Make ``page_view`` (a uint8 view of exactly the chunk's bytes) hold the chunk.

        Returns ``(sender's checksum, checksum of the bytes that landed)``; the second is None
        when the channel did not hash while receiving (the tier then hashes the page).
        """

    def close(self) -> None:
        return None


class SenderChannel(ABC):
    name: str

    def hello_fields(self) -> dict[str, Any]:
        """Extra Hello fields this transport sends (called before ``attach``)."""
        return {}

    @abstractmethod
    def attach(self, reply: HelloReply) -> None:
        """Reach the receiver's buffer described by its HelloReply."""

    @abstractmethod
    def send_chunk(
        self, sock: socket.socket, request_id: str, index: int, page: int, data: torch.Tensor
    ) -> int:
        """Move ``data`` (any shape; its bytes in canonical order are the chunk) into the
        receiver's ``page`` and send the ChunkSent message (with the chunk checksum of
        :mod:`kvtier.pd.checksum`) for it. Returns the bytes moved."""

    def close(self) -> None:
        return None
