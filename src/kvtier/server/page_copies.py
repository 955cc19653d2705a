"""A server client's copies between its caller's KV and the server's shared pages, and the
fences that say when they landed.

The pages are the server's, and it reuses them at the moments below; every copy into or out
of a page must have landed before then::

    copy                         made by    must land before                waited for by
    store: KV -> reserved pages  copy_in    Commit (the server reads the    land_stores(): the
                                            pages next)                     storing thread
    load: pages -> out           copy_out   EndRequest of its request (the  land(request_id)
                                            lease's pages go back)
    any still running            -          the connection closes or        land_all()
                                            breaks (the server releases
                                            all it held at once)

A fence leaves the books only once it has landed, so every waiter waits for it: the storing
thread waiting for its own copies and another thread that finds the connection broken
(``land_all``) both wait, whichever comes first.

Host tensors are copied on threads of their own (:mod:`kvtier.memory.host_copy`) and have
landed when the call returns; device tensors go through the device-copy owner
(:mod:`kvtier.memory.device`), whose copies may land later.
"""

from __future__ import annotations

import threading

import torch

from kvtier.errors import TransferError
from kvtier.layout import KVLayout
from kvtier.memory.device import CopyEngine, DeviceCopies, Direction, Landed
from kvtier.memory.host_copy import HostCopies, Pair
from kvtier.server import protocol as wire
from kvtier.server.link import ServerLink


class PageCopies:
    """The copies of one :class:`~kvtier.server.client.ServerClient` (see the module
    docstring). ``copies``: the device-copy engine (None: the default one)."""

    def __init__(self, link: ServerLink, layout: KVLayout, copies: CopyEngine | None) -> None:
        self._link = link
        self.layout = layout
        self._copies = copies if copies is not None else DeviceCopies()
        # Host-to-host copies on threads of its own, not torch's (kvtier.memory.host_copy),
        # where the default engine would copy them at once anyway; a copy engine of the
        # caller's own kind (a test's late copies, say) makes every copy.
        default = type(self._copies) is DeviceCopies
        self._host = HostCopies(torch.get_num_threads()) if default else None
        self._lock = threading.Lock()
        self._stores: list[Landed] = []  # copies into reserved pages, not known landed
        self._loads: dict[str, list[Landed]] = {}  # per request: copies out of its pages

    def open(self) -> None:
        if self._host is not None:
            self._host.open()

    def close(self) -> None:
        if self._host is not None:
            self._host.close()

    # -- copies ------------------------------------------------------------------------------
    def copy_out(self, request_id: str, pages: wire.Pages, out: torch.Tensor, base: int) -> None:
        """Out of the pages ``request_id``'s server lease holds (``out``'s row 0: token
        ``base``); the copies may land later (a device ``out``): :meth:`land` waits."""
        if self._host is not None and out.device.type == "cpu":
            pairs: list[Pair] = []
            for page, start, count in zip(pages.pages, pages.starts, pages.counts, strict=True):
                dst = out[:, :, start - base : start - base + count, :]
                self.layout.unpack(self._page(page, count), dst, lambda d, s: pairs.append((d, s)))
            self._host.run(pairs)
            return
        batch = self._copies.begin(out, Direction.LOAD)
        try:
            for page, start, count in zip(pages.pages, pages.starts, pages.counts, strict=True):
                dst = out[:, :, start - base : start - base + count, :]
                self.layout.unpack(self._page(page, count), dst, batch.copy)
        finally:
            landed = batch.close()
            if not landed.done():
                with self._lock:
                    self._loads.setdefault(request_id, []).append(landed)

    def copy_in(self, slots: wire.Pages, kv: torch.Tensor, base: int) -> None:
        """Into the reserved pages (``kv``'s row 0: token ``base``); the copies may land later
        (a device ``kv``): :meth:`land_stores` waits, before the Commit. When a copy raises,
        what was begun is on the books all the same."""
        if self._host is not None and kv.device.type == "cpu":
            pairs: list[Pair] = []
            for page, start, count in zip(slots.pages, slots.starts, slots.counts, strict=True):
                src = kv[:, :, start - base : start - base + count, :]
                self.layout.pack(src, self._page(page, count), lambda d, s: pairs.append((d, s)))
            self._host.run(pairs)
            return
        batch = self._copies.begin(kv, Direction.STORE)
        try:
            for page, start, count in zip(slots.pages, slots.starts, slots.counts, strict=True):
                src = kv[:, :, start - base : start - base + count, :]
                self.layout.pack(src, self._page(page, count), batch.copy)
        finally:
            landed = batch.close()
            if not landed.done():
                with self._lock:
                    self._stores.append(landed)

    # -- fences ------------------------------------------------------------------------------
    def land_stores(self) -> None:
        """Wait for every copy into reserved pages."""
        with self._lock:
            pending = list(self._stores)
        self._wait(pending)

    def land(self, request_id: str) -> None:
        """Wait for every copy out of ``request_id``'s pages."""
        with self._lock:
            pending = list(self._loads.get(request_id, ()))
        self._wait(pending)

    def land_all(self) -> None:
        """Wait for every copy still running into or out of this connection's pages."""
        with self._lock:
            pending = self._stores + [f for fences in self._loads.values() for f in fences]
        self._wait(pending)

    def _wait(self, pending: list[Landed]) -> None:
        for landed in pending:
            landed.wait()
        with self._lock:  # off the books only now that they landed
            self._stores = [f for f in self._stores if not f.done()]
            loads = {rid: [f for f in fs if not f.done()] for rid, fs in self._loads.items()}
            self._loads = {rid: fences for rid, fences in loads.items() if fences}

    def _page(self, page: int, num_tokens: int) -> torch.Tensor:
        """The bytes of a chunk of ``num_tokens`` in shared page ``page`` (flat uint8)."""
        buffer = self._link.pages
        assert buffer is not None
        start = page * self._link.page_bytes
        nbytes = self.layout.payload_bytes(num_tokens) if num_tokens > 0 else 0
        if page < 0 or start + self._link.page_bytes > buffer.numel():
            raise TransferError(f"the server named page {page}, outside the shared buffer")
        if not 0 < nbytes <= self._link.page_bytes:
            raise TransferError(f"the server named {num_tokens} tokens for one page")
        return buffer[start : start + nbytes]
