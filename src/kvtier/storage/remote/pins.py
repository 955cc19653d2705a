"""Pins on a store a fleet shares: they keep this tier's own ``clear`` off a chunk, no more.

A shared store cannot hold an entry for a request: other engines, the store's own eviction
or expiry, and a tenant's cap (``tenant_quotas``) may delete it at any time. So ``pin``
answers True (the chunk may be used; a later read may still miss, which the manager
tolerates by ending the hit there) and only counts, so that ``clear`` through this tier
spares the chunks this engine's requests are using. A count never goes below zero: a stray
``unpin`` is a no-op.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvtier.keys import ChunkKey


class PinCounts:
    """The pin counts of one remote tier (module docstring). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[ChunkKey, int] = {}

    def pin(self, key: ChunkKey) -> bool:
        """Always True: see the module docstring."""
        return self.pin_many((key,)) == 1

    def pin_many(self, keys: Sequence[ChunkKey]) -> int:
        with self._lock:
            counts = self._counts
            for key in keys:
                counts[key] = counts.get(key, 0) + 1
        return len(keys)

    def unpin(self, key: ChunkKey) -> None:
        self.unpin_many((key,))

    def unpin_many(self, keys: Sequence[ChunkKey]) -> None:
        with self._lock:
            counts = self._counts
            for key in keys:
                count = counts.get(key, 0)
                if count <= 1:
                    counts.pop(key, None)
                else:
                    counts[key] = count - 1

    def pinned(self) -> set[ChunkKey]:
        """The keys pinned now (what ``clear`` keeps)."""
        with self._lock:
            return set(self._counts)
