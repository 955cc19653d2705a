"""The eviction policy seam: which cached chunk a tier drops, and which it declines to keep.

A tier owns its index (key -> where the bytes are) and every reference count; a policy owns
only an order over the keys the tier holds. The protocol, as the CPU tier drives it::

    tier.insert(key)      policy.admit(key, num_tokens) -> False: declined, nothing kept
                          (the policy may remember the key as a ghost, so that a second
                          use is admitted); True: the tier indexes it, then policy.insert(key)
                          (LRU and REUSE admit every chunk: docs/policies.md says why)
    tier lookup / hit     policy.touch(keys)       one batch per lookup, in prompt order
    tier.remove(key)      policy.remove(key)       the tier dropped it for its own reasons
    tier short of room    policy.evict(n, evictable) -> up to n keys, best victims first,
                          each one that ``evictable(key)`` allowed; the policy forgets them
                          and the tier drops them from its index

``evictable`` is the tier's answer to "does anyone besides the cache hold this chunk?" (a pin
by a request's lease, a write in flight): pins and reference counts stay with the page pool
and never reach the policy, as a page cache keeps them apart from its replacement order.

Keys are prefix-chained (``kvtier.keys``): chunk ``i`` is useful only while chunks ``0..i-1``
are cached, because a lookup stops at the first miss. A policy may use that (drop a child
before its parent) but must not rely on it for correctness.

Called under the tier's lock: a policy needs no lock of its own. ``touch`` is on the lookup
path of every request: implementations use C-level bulk operations (``map`` over the batch),
not a Python statement per key.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import ClassVar

from kvtier.keys import ChunkKey

Evictable = Callable[[ChunkKey], bool]


class EvictionPolicy(ABC):
    name: ClassVar[str]

    @abstractmethod
    def admit(self, key: ChunkKey, num_tokens: int) -> bool:
        """Whether to keep ``key`` (not cached) at all. A declined key is not inserted."""

    @abstractmethod
    def insert(self, key: ChunkKey) -> None:
        """``key`` (admitted, not yet known to the policy) is now cached."""

    @abstractmethod
    def touch(self, keys: Sequence[ChunkKey]) -> None:
        """``keys`` (all cached) were used by one request, in prompt order."""

    @abstractmethod
    def remove(self, key: ChunkKey) -> None:
        """Forget ``key`` (cached or not: a no-op when unknown)."""

    @abstractmethod
    def evict(self, count: int, evictable: Evictable) -> list[ChunkKey]:
        """Up to ``count`` victims among the keys ``evictable`` allows, best first; they are
        forgotten here and must be dropped by the tier. Fewer when fewer are evictable."""

    @abstractmethod
    def order(self) -> Iterator[ChunkKey]:
        """Every cached key, the next victim first (for snapshots and tests)."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    def clear(self) -> None:
        """Forget every key (ghosts too)."""
        for key in list(self.order()):
            self.remove(key)
