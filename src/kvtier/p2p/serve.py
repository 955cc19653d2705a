"""Serving a peer's Fetch on one connection: chunks out of this server's CPU tier, onto the wire.

Each chunk is sent straight from the CPU tier's page (:meth:`CpuTier.read_view`: a read
reference holds the page for the send, bounded by the Fetch's deadline; eviction still drops
the entry at once, only the page's reuse waits), after its checksum (PD's) is taken there.
An entry that is not a page (a codec's) is copied into the connection's scratch page first
(``Tier.get_into``) and sent from there. A chunk the CPU tier no longer holds is a
``Missing`` (evicted since it was announced): the puller's miss.

Why no copy: on loopback the raw socket already keeps both cores of this host busy (the
sender's copy into the kernel, the receiver's out of it); a third pass over every byte (the
scratch copy, 1.2 ms of each 8 MiB chunk's 3.9, profiled with timing splits) came straight
off the pull's rate.

Tried and left out: reading chunk ``i + 1`` on a helper thread while chunk ``i`` is sent. On
these 2 cores at load average 9-12 (other sessions' tests) ``kvtier bench p2p`` showed no gain
(pull / raw socket 0.36-0.90 with it, 0.25-0.90 without, run to run): not worth a thread per
connection until a quiet host with cores to spare says otherwise.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch

from kvtier.framing import send as send_bytes
from kvtier.keys import ChunkKey
from kvtier.layout import KVLayout
from kvtier.p2p import protocol as wire
from kvtier.pd.checksum import checksum
from kvtier.storage.base import Tier
from kvtier.storage.cpu import CpuTier


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
        cpu = model.cpu
        in_place = cpu if isinstance(cpu, CpuTier) and cpu.entries_store.resident else None
        for i, key in enumerate(keys):
            reading = in_place.read_view(key) if in_place else _copied(cpu, key, page)
            with reading as held:
                if held is None:
                    wire.send(sock, wire.Missing(i, "evicted since it was announced"), deadline)
                    continue
                stored, tokens = held
                nbytes = layout.payload_bytes(tokens)
                payload = stored[:nbytes]
                wire.send(sock, wire.Chunk(i, tokens, nbytes, checksum(payload)), deadline)
                send_bytes(sock, memoryview(payload.numpy()), deadline)  # type: ignore[arg-type]
            sent += 1
        wire.send(sock, wire.Done(transfer_id), deadline)
        return sent


@contextlib.contextmanager
def _copied(
    cpu: Tier, key: ChunkKey, page: torch.Tensor
) -> Iterator[tuple[torch.Tensor, int] | None]:
    """``key``'s payload copied into ``page`` (an entry that is not a page), or None."""
    tokens = cpu.get_into(key, page)
    yield None if tokens is None else (page, tokens)
