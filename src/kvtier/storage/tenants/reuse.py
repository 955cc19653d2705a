"""Whether a tenant's chunks come back: what keeps its guarantee.

A guarantee reserves room for a tenant (:mod:`kvtier.storage.tenants.local`, rule 2). The
room is worth keeping only while the chunks it holds are used again: a tenant that scans
documents it reads once would otherwise keep its whole guarantee filled with chunks nobody
asks for, and every other tenant would lose that room for nothing.

So each tenant with a limit has a :class:`ReuseWatch`, which looks at the chunks it *loses*
(every eviction of its chunks, by its own quota or by others)::

    a lost chunk that was hit while held             the tenant's chunks come back
    a chunk stored again while in the ghost list     (the last `window` keys it lost)
    `window` lost chunks in a row with neither       they do not: its guarantee lapses

``window`` is the tenant's guarantee in chunks (at least :data:`MIN_WINDOW`): a tenant lapses
only after it has lost a whole guarantee's worth of chunks, none of them used, and none of
the last ``window`` of them asked for again since. The next chunk that comes back restores
its guarantee at once. Hits alone do not keep it: a scanner whose prompts share a hot system
prompt hits that chunk on every request, and it is the room beside it that goes unused.

Costs: O(1) per chunk stored, hit or lost; the ghost list is keys only, ``window`` of them.
"""

from __future__ import annotations

from collections import OrderedDict

from kvtier.keys import ChunkKey
from kvtier.storage.policy.base import Evictable

MIN_WINDOW = 16  # chunks: a tenant with a tiny guarantee does not lapse on a handful


class ReuseWatch:
    """One tenant's record of whether the chunks it loses are ones it uses."""

    __slots__ = ("_ghosts", "_hit", "lost_unused", "window")

    def __init__(self) -> None:
        self._hit: set[ChunkKey] = set()  # held chunks hit since they were stored
        self._ghosts: OrderedDict[ChunkKey, None] = OrderedDict()
        self.lost_unused = 0  # chunks lost in a row, never hit, none stored again since
        self.window = MIN_WINDOW

    @property
    def lapsed(self) -> bool:
        return self.lost_unused >= self.window

    @property
    def used_held(self) -> int:
        """Chunks it holds that were hit: what a lapsed tenant keeps (hot prefixes)."""
        return len(self._hit)

    def unused_among(self, evictable: Evictable) -> Evictable:
        """``evictable``, less the chunks it uses: what a lapsed tenant gives up first (a
        refused chunk is held by the policy until an eviction finds it evictable again)."""
        used = self._hit
        return lambda key: key not in used and evictable(key)

    def resize(self, guarantee_chunks: int) -> None:
        self.window = max(MIN_WINDOW, guarantee_chunks)

    def stored(self, key: ChunkKey) -> None:
        """``key`` was stored: one the tenant lost and asked for again restores it."""
        if self._ghosts.pop(key, 0) is None:
            self.lost_unused = 0

    def hit(self, key: ChunkKey) -> None:
        self._hit.add(key)

    def lost(self, key: ChunkKey) -> None:
        """``key`` was evicted (by its own quota or by others)."""
        if key in self._hit:
            self._hit.discard(key)
            self.lost_unused = 0
        else:
            self.lost_unused += 1
        ghosts = self._ghosts
        ghosts[key] = None
        while len(ghosts) > self.window:
            ghosts.popitem(last=False)

    def removed(self, key: ChunkKey) -> None:
        """``key`` left without an eviction (deleted, cleared): it says nothing of reuse."""
        self._hit.discard(key)

    def clear(self) -> None:
        self._hit.clear()
        self._ghosts.clear()
        self.lost_unused = 0


class ReuseWatches:
    """The watches of one tier's tenants with a limit, and which of them lapsed: what
    :class:`~kvtier.storage.tenants.local.TenantPolicy` asks, one call per event."""

    __slots__ = ("_watch", "lapsed")

    def __init__(self) -> None:
        self._watch: dict[str, ReuseWatch] = {}
        self.lapsed: set[str] = set()  # kept as watches change: an eviction reads only these

    def get(self, tenant: str) -> ReuseWatch | None:
        return self._watch.get(tenant)

    def stored(self, tenant: str, key: ChunkKey) -> None:
        """A chunk of ``tenant`` (which has a limit) was stored."""
        watch = self._watch.get(tenant)
        if watch is None:
            watch = self._watch[tenant] = ReuseWatch()
        watch.stored(key)
        if not watch.lapsed:
            self.lapsed.discard(tenant)

    # hit, lost and removed take None (the group with no limit, never watched): nothing.
    def hit(self, tenant: str | None, keys: list[ChunkKey]) -> None:
        watch = self._watch.get(tenant) if tenant is not None else None
        if watch is not None:
            for key in keys:
                watch.hit(key)

    def lost(self, tenant: str | None, key: ChunkKey, guarantee_chunks: int) -> None:
        watch = self._watch.get(tenant) if tenant is not None else None
        if watch is None or tenant is None:
            return
        watch.resize(guarantee_chunks)
        watch.lost(key)
        if watch.lapsed:
            self.lapsed.add(tenant)
        else:
            self.lapsed.discard(tenant)

    def removed(self, tenant: str | None, key: ChunkKey) -> None:
        watch = self._watch.get(tenant) if tenant is not None else None
        if watch is not None:
            watch.removed(key)

    def forget(self, tenant: str) -> None:
        """``tenant`` holds nothing more, or lost its limit."""
        self._watch.pop(tenant, None)
        self.lapsed.discard(tenant)

    def keep_only(self, tenants: set[str | None]) -> None:
        """Forget every watch but those of ``tenants`` (the groups tenants are in now)."""
        for tenant in [t for t in self._watch if t not in tenants]:
            self.forget(tenant)

    def items(self) -> list[tuple[str, ReuseWatch]]:
        return list(self._watch.items())

    def clear(self) -> None:
        self._watch.clear()
        self.lapsed.clear()
