"""Serving a peer's Fetch on one connection: chunks out of this server's CPU tier, onto the wire.

Each chunk is copied out of the CPU tier into the connection's scratch page (``Tier.get_into``:
the tier's own reference keeps its page alive during the copy; nothing here holds a CPU page,
so eviction never waits on a slow peer), checksummed (PD's), and sent from there. A chunk the
CPU tier no longer holds is a ``Missing`` (evicted since it was announced): the puller's miss.

Tried and left out: reading chunk ``i + 1`` on a helper thread while chunk ``i`` is sent. On
these 2 cores at load average 9-12 (other sessions' tests) ``kvtier bench p2p`` showed no gain
(pull / raw socket 0.36-0.90 with it, 0.25-0.90 without, run to run): not worth a thread per
connection until a quiet host with cores to spare says otherwise.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Protocol

import torch

from kvtier.framing import send as send_bytes
from kvtier.keys import ChunkKey
from kvtier.layout import KVLayout
from kvtier.p2p import protocol as wire
from kvtier.pd.checksum import checksum
from kvtier.storage.base import Tier


class ServedModel(Protocol):
    """One model a node serves: its CPU tier, layout and page size."""

    cpu: Tier
    layout: KVLayout
    page_bytes: int


class FetchServer:
    def __init__(self) -> None:
        self._pages: dict[int, torch.Tensor] = {}

    def close(self) -> None:
        self._pages.clear()

    def serve(
        self,
        sock: socket.socket,
        transfer_id: str,
        keys: Sequence[ChunkKey],
        model: ServedModel,
        deadline: float,
    ) -> int:
        """Send each of ``keys`` (a Chunk and its bytes, or a Missing), then Done, all of it
        by ``deadline`` (a puller that stops reading is cut off); returns the chunks sent."""
        layout = model.layout
        page = self._pages.get(model.page_bytes)
        if page is None:
            page = self._pages[model.page_bytes] = torch.empty(model.page_bytes, dtype=torch.uint8)
        sent = 0
        for i, key in enumerate(keys):
            tokens = model.cpu.get_into(key, page)
            if tokens is None:
                wire.send(sock, wire.Missing(i, "evicted since it was announced"), deadline)
                continue
            nbytes = layout.payload_bytes(tokens)
            payload = page[:nbytes]
            wire.send(sock, wire.Chunk(i, tokens, nbytes, checksum(payload)), deadline)
            send_bytes(sock, memoryview(payload.numpy()), deadline)  # type: ignore[arg-type]
            sent += 1
        wire.send(sock, wire.Done(transfer_id), deadline)
        return sent
