"""Same-host shared-memory transport: the receive buffer is a /dev/shm segment.

The receiver creates the segment (a file in /dev/shm, unlinked at close, and held by a lock
so that a later receiver removes it if its process dies first:
:mod:`kvtier.pd.channels.shm_segments`), maps it and pages it with its :class:`BlockPool`;
the HelloReply gives the segment's name, never a path. The sender finds that name in its own
/dev/shm, checks the file (its own uid's regular file, large enough: ``open_segment``), maps
it and copies each chunk once, straight into the page the AllocReply named, copying each
block with streaming stores and hashing it from the cache right after
(:func:`kvtier.pd.checksum.copy_with_checksum`, one thread or two), then sends the ChunkSent
header with that checksum. Before each chunk it checks that the file still holds the mapping.

The receiver does not hash at publish (``verify_at_serve``): the PD tier verifies every byte
against the sender's checksum while it copies the chunk out to serve it, in the same pass
as that copy. A page changed by a stray write is then a checksum miss at serve time: the hit
ends there and the decoder recomputes the rest, as with a corrupt disk chunk.
"""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from kvtier.errors import TransferError
from kvtier.memory.block_pool import BlockPool
from kvtier.pd.channels.base import ReceiverChannel, SenderChannel
from kvtier.pd.channels.shm_segments import PeerSegment, Segment, create_segment, open_segment
from kvtier.pd.checksum import CopyThreads
from kvtier.pd.protocol import ChunkSent, Hello, HelloReply, send_message

SHM_DIR = "/dev/shm"


class ShmReceiver(ReceiverChannel):
    name = "shm"
    verify_at_serve = True

    def __init__(self) -> None:
        self._segment: Segment | None = None

    def make_pool(self, num_pages: int, page_bytes: int) -> BlockPool:
        self._segment = create_segment(SHM_DIR, num_pages * page_bytes)
        return BlockPool(num_pages, page_bytes, mapping=self._segment.mapping)

    @property
    def shm_path(self) -> str:
        """This receiver's own segment file (for its tests and logs; a sender is told only
        the name)."""
        return self._segment.path if self._segment is not None else ""

    def greet(self, hello: Hello) -> dict[str, Any]:
        return {"shm_segment": self._segment.name if self._segment is not None else ""}

    def receive_chunk(
        self, sock: socket.socket, page_view: torch.Tensor, msg: ChunkSent
    ) -> tuple[int, int | None]:
        return msg.checksum, None  # the sender wrote the bytes; verified when served

    def close(self) -> None:
        segment, self._segment = self._segment, None
        if segment is not None:
            segment.remove()


class ShmSender(SenderChannel):
    name = "shm"

    def __init__(self) -> None:
        self._segment: PeerSegment | None = None
        self._buffer: torch.Tensor | None = None
        self._page_bytes = 0
        self._helper: ThreadPoolExecutor | None = None  # copies and hashes half of a chunk
        self._copier: CopyThreads | None = None

    def attach(self, reply: HelloReply) -> None:
        if reply.num_pages <= 0 or reply.page_bytes <= 0:
            raise TransferError(
                f"receiver described an empty buffer ({reply.num_pages} pages of "
                f"{reply.page_bytes} bytes)"
            )
        nbytes = reply.num_pages * reply.page_bytes
        self._segment = open_segment(SHM_DIR, reply.shm_segment, nbytes)
        self._buffer = torch.frombuffer(self._segment.mapping, dtype=torch.uint8, count=nbytes)
        self._page_bytes = reply.page_bytes
        self._helper = ThreadPoolExecutor(1, thread_name_prefix="kvtier-shm-copy")
        self._copier = CopyThreads(self._helper)

    def send_chunk(
        self, sock: socket.socket, request_id: str, index: int, page: int, data: torch.Tensor
    ) -> int:
        assert self._buffer is not None and self._copier is not None, "attach() first"
        assert self._segment is not None
        nbytes = data.numel() * data.element_size()
        if nbytes > self._page_bytes:
            raise TransferError(
                f"chunk of {nbytes} bytes does not fit a {self._page_bytes}-byte page"
            )
        self._segment.check()  # one fstat per chunk (~1 us against ~2 ms for 32 MiB)
        start = page * self._page_bytes
        dst = self._buffer[start : start + nbytes]
        # The one pass over the bytes; the checksum is of what this sender meant to send, and
        # the decoder checks the page against it when it serves the chunk.
        digest = self._copier.copy(dst, data)
        send_message(sock, ChunkSent(request_id, index, nbytes, digest))
        return nbytes

    def close(self) -> None:
        # Not mmap.close(): torch views hold no buffer export, so closing would unmap memory
        # a view may still use (see HostBuffer.release); the mapping goes with its last view.
        self._buffer = None
        segment, self._segment = self._segment, None
        if segment is not None:
            segment.close()
        if self._helper is not None:
            self._helper.shutdown(wait=True)
            self._helper = None
        self._copier = None
