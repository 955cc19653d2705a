"""What an s3 tier's prefix holds, in memory: chunk key -> object size.

Two sources keep it current (:mod:`kvtier.storage.s3.store` says when): the tier's own writes
(:meth:`add`, once the PUT returned) and listings of the prefix (:meth:`replace`). A listing
takes time; a write that lands while it runs may be missing from it, so each entry carries
the generation it was added at, and :meth:`replace` keeps the entries added since the listing
began; a key removed while it ran (a delete, a 404, a corrupt record) may still be in it, so
removals carry their generation too and :meth:`replace` leaves them out::

    g = index.generation()          # before the listing's first request
    listed = list(prefix)           # ... writes and removals land meanwhile (generation > g)
    index.replace(listed, since=g)  -> listed, less what was removed after g,
                                       plus what was added after g
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence

from kvtier.keys import ChunkKey


class ChunkIndex:
    """Thread-safe; every method holds one lock briefly (a 512-key lookup: dict lookups)."""

    def __init__(self) -> None:
        self._sizes: dict[ChunkKey, int] = {}
        self._added_at: dict[ChunkKey, int] = {}
        self._removed_at: dict[ChunkKey, int] = {}
        self._generation = 0
        self._lock = threading.Lock()

    def generation(self) -> int:
        with self._lock:
            self._generation += 1
            return self._generation

    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        with self._lock:
            sizes = self._sizes
            return [key in sizes for key in keys]

    def add(
        self, key: ChunkKey, size: int, then: Callable[[Sequence[ChunkKey]], None] | None = None
    ) -> None:
        """Hold ``key``; ``then((key,))`` runs under the lock (a report of the addition that
        no removal of the same key can overtake)."""
        with self._lock:
            self._generation += 1
            self._sizes[key] = size
            self._added_at[key] = self._generation
            self._removed_at.pop(key, None)
            if then is not None:
                then((key,))

    def discard(self, key: ChunkKey) -> bool:
        """Forget ``key``; True when it was held."""
        with self._lock:
            self._forget(key)
            return self._sizes.pop(key, None) is not None

    def discard_many(self, keys: Sequence[ChunkKey]) -> None:
        with self._lock:
            for key in keys:
                self._forget(key)
                self._sizes.pop(key, None)

    def _forget(self, key: ChunkKey) -> None:
        self._generation += 1
        self._added_at.pop(key, None)
        self._removed_at[key] = self._generation

    def replace(self, listed: Mapping[ChunkKey, int], *, since: int) -> None:
        """Hold what a listing begun at generation ``since`` found, less what was removed
        after it began, plus what was added after it began."""
        with self._lock:
            removed = {key for key, at in self._removed_at.items() if at > since}
            sizes = {key: size for key, size in listed.items() if key not in removed}
            self._removed_at = {key: self._removed_at[key] for key in removed}
            added_at = {}
            for key, at in self._added_at.items():
                if at > since:
                    sizes[key] = self._sizes[key]
                    added_at[key] = at
            self._sizes = sizes
            self._added_at = added_at

    def totals(self) -> tuple[int, int]:
        """(bytes, entries) of what the index holds."""
        with self._lock:
            return sum(self._sizes.values()), len(self._sizes)


def chunk_key_of(prefix: str, name: str) -> ChunkKey | None:
    """The chunk key of object ``name`` under ``prefix`` (``<prefix><key hex>``), or None
    for any other object (a foreign file, a marker directory)."""
    tail = name[len(prefix) :] if name.startswith(prefix) else ""
    try:
        key = bytes.fromhex(tail)
    except ValueError:
        return None
    return key if len(key) == 16 else None
