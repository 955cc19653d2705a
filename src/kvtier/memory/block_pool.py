"""The block pool: the only code in kvtier that changes reference counts or the free list.

A page is one chunk's worth of bytes in the host buffer. Each page has a reference count:

    ref == 0   free (on the free list)
    ref >= 1   owned. Each owner holds exactly one reference:
               - a cache entry of the CPU tier (the tier's index),
               - a request lease (a pin: "this request will read or is reading this page"),
               - an in-flight write to a lower tier (the page is the source of the write),
               - a PD reservation (the page is being filled by a sender).

An owner gives its reference back exactly once; the objects that own references (``Lease``,
the CPU tier's index, a write ticket) guard that, and the pool refuses a decrement below
zero loudly instead of clamping it, because a clamp hides a double release that would free
memory still in use. A page is evictable when its only reference is the cache's own.

Capacity arithmetic (sizes are ceilings, rounded down to whole pages, never hand-aligned)::

    pages = floor(capacity_bytes / chunk_bytes)     0 pages -> ConfigError naming the key
    used  = pages * chunk_bytes                     cut  = capacity_bytes - used (logged)
"""

from __future__ import annotations

import logging
import mmap
import threading
from collections.abc import Iterable

import torch

from kvtier.config.sizes import format_size
from kvtier.errors import ConfigError
from kvtier.memory.buffer import HostBuffer

log = logging.getLogger(__name__)


def pages_for_capacity(key: str, capacity_bytes: int, chunk_bytes: int) -> int:
    """Whole chunk pages that fit in ``capacity_bytes`` (a ceiling). Logs the cut, if any."""
    pages = capacity_bytes // chunk_bytes
    if pages < 1:
        raise ConfigError(
            key,
            capacity_bytes,
            f"at least one chunk ({chunk_bytes} bytes = {format_size(chunk_bytes)}) for this "
            "model layout and chunk_size",
        )
    used = pages * chunk_bytes
    if used != capacity_bytes:
        log.info(
            "%s: asked %d bytes, using %d bytes (%d chunks of %d bytes; %d bytes unused)",
            key,
            capacity_bytes,
            used,
            pages,
            chunk_bytes,
            capacity_bytes - used,
        )
    return pages


class BlockPool:
    """Fixed-size pages over one :class:`HostBuffer`, with reference counts and a free list.

    Thread-safe: tier completion callbacks release references from I/O threads.
    """

    def __init__(
        self, num_pages: int, page_bytes: int, *, mapping: mmap.mmap | None = None
    ) -> None:
        """``mapping``: optional existing memory to page (see :class:`HostBuffer`)."""
        if num_pages < 1 or page_bytes < 1:
            raise ValueError(
                f"BlockPool needs pages >= 1 and page_bytes >= 1, got {num_pages}, {page_bytes}"
            )
        self.num_pages = num_pages
        self.page_bytes = page_bytes
        self._buffer = HostBuffer(num_pages * page_bytes, mapping)
        self._refs = [0] * num_pages
        # LIFO free list: the most recently freed page is reused first (warm in cache).
        self._free = list(range(num_pages - 1, -1, -1))
        self._lock = threading.Lock()
        self._closed = False

    # -- allocation ------------------------------------------------------------------------
    def allocate(self, count: int) -> list[int] | None:
        """``count`` pages, each with one reference for the caller, or None if not all fit.

        All or nothing, so two callers can never each hold half of what they need.
        """
        with self._lock:
            self._check_open()
            if count > len(self._free):
                return None
            pages = [self._free.pop() for _ in range(count)]
            for page in pages:
                self._refs[page] = 1
            return pages

    def retain(self, pages: Iterable[int]) -> None:
        """Add one reference to each page (which must already be owned)."""
        with self._lock:
            refs = self._refs
            for page in pages:
                if refs[page] <= 0:
                    raise AssertionError(f"retain of free page {page}: it has no owner to share")
                refs[page] += 1

    def release(self, pages: Iterable[int]) -> None:
        """Drop one reference from each page; a page whose count reaches 0 is free again."""
        with self._lock:
            refs = self._refs
            for page in pages:
                if refs[page] <= 0:
                    raise AssertionError(
                        f"release of page {page} with refcount {refs[page]}: a double release"
                    )
                refs[page] -= 1
                if refs[page] == 0:
                    self._free.append(page)

    # -- inspection ------------------------------------------------------------------------
    def refcount(self, page: int) -> int:
        return self._refs[page]

    def is_shared(self, page: int) -> bool:
        """True when someone besides the first owner holds the page (pinned or in use)."""
        return self._refs[page] > 1

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def refcounts(self) -> list[int]:
        with self._lock:
            return list(self._refs)

    def snapshot(self) -> tuple[list[int], int]:
        """(refcount of every page, length of the free list), read at one instant."""
        with self._lock:
            return list(self._refs), len(self._free)

    # -- data ------------------------------------------------------------------------------
    def page_bytes_view(self, page: int, nbytes: int | None = None) -> torch.Tensor:
        """The first ``nbytes`` of ``page`` as a flat uint8 tensor (a view, no copy)."""
        self._check_open()
        start = page * self.page_bytes
        return self._buffer.tensor[start : start + (self.page_bytes if nbytes is None else nbytes)]

    @property
    def base_address(self) -> int:
        return self._buffer.address

    @property
    def buffer(self) -> torch.Tensor:
        """The whole buffer (for transports that register it once)."""
        return self._buffer.tensor

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._buffer.release()

    def _check_open(self) -> None:
        if self._closed:
            raise AssertionError("block pool used after close")
