"""``LRU``: one least-recently-used list; a lookup's keys become most recent in prompt order.

Admits everything and keeps no ghosts. Kept as the reference (``kvtier bench trace`` measures
every policy against it) and for deployments whose reuse has no frequency signal.

A held key (:mod:`.base`) rejoins as the most recently used. LRU orders by last use, and a
held chunk is in use (a request reading it, a write copying it to a lower tier) until its
last holder lets go: then it *is* the most recently used chunk. (vLLM's block pool puts a
freed block at the tail of its free queue, SQLite's page cache an unpinned page at the
young end of its LRU, for the same reason.) So a use while held needs no record.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence

from kvtier.keys import ChunkKey
from kvtier.storage.policy.base import Evictable, EvictionPolicy


class LruPolicy(EvictionPolicy):
    name = "LRU"

    def __init__(self) -> None:
        super().__init__()
        self._order: OrderedDict[ChunkKey, None] = OrderedDict()

    def admit(self, key: ChunkKey, num_tokens: int) -> bool:
        return True

    def insert(self, key: ChunkKey) -> None:
        self._order[key] = None

    def touch(self, keys: Sequence[ChunkKey]) -> None:
        held = self._held
        if held and not held.keys().isdisjoint(keys):  # held keys rejoin as newest anyway
            keys = [k for k in keys if k not in held]
        deque(map(self._order.move_to_end, keys), maxlen=0)  # C-level: no Python per key

    def remove(self, key: ChunkKey) -> None:
        self._order.pop(key, None)
        self._held.pop(key, None)

    def _select(self, count: int, evictable: Evictable, refused: list[ChunkKey]) -> list[ChunkKey]:
        victims: list[ChunkKey] = []
        for key in self._order:  # oldest first
            if evictable(key):
                victims.append(key)
                if len(victims) >= count:
                    break
            else:
                refused.append(key)
        for key in victims:
            del self._order[key]
        return victims

    def _leave(self, keys: Sequence[ChunkKey]) -> None:
        deque(map(self._order.pop, keys), maxlen=0)

    def _rejoin(self, key: ChunkKey) -> None:
        self._order[key] = None  # the newest: see the module docstring

    def order(self) -> Iterator[ChunkKey]:
        return iter([*self._order, *self._held])

    def __len__(self) -> int:
        return len(self._order) + len(self._held)

    def __contains__(self, key: object) -> bool:
        return key in self._order or key in self._held

    def clear(self) -> None:
        self._order.clear()
        self._held.clear()
