"""``LRU``: one least-recently-used list; a lookup's keys become most recent in prompt order.

Admits everything and keeps no ghosts. Kept as the reference (``kvtier bench trace`` measures
every policy against it) and for deployments whose reuse has no frequency signal.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence

from kvtier.keys import ChunkKey
from kvtier.storage.policy.base import Evictable, EvictionPolicy


class LruPolicy(EvictionPolicy):
    name = "LRU"

    def __init__(self) -> None:
        self._order: OrderedDict[ChunkKey, None] = OrderedDict()

    def admit(self, key: ChunkKey, num_tokens: int) -> bool:
        return True

    def insert(self, key: ChunkKey) -> None:
        self._order[key] = None

    def touch(self, keys: Sequence[ChunkKey]) -> None:
        deque(map(self._order.move_to_end, keys), maxlen=0)  # C-level: no Python per key

    def remove(self, key: ChunkKey) -> None:
        self._order.pop(key, None)

    def evict(self, count: int, evictable: Evictable) -> list[ChunkKey]:
        victims: list[ChunkKey] = []
        if count <= 0:
            return victims
        for key in self._order:  # oldest first
            if evictable(key):
                victims.append(key)
                if len(victims) >= count:
                    break
        for key in victims:
            del self._order[key]
        return victims

    def order(self) -> Iterator[ChunkKey]:
        return iter(list(self._order))

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def clear(self) -> None:
        self._order.clear()
