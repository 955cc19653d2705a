"""``REUSE``: keep what has been reused for as long as it pays, drop children before parents.

Two observations about prefix caches, each checked on the Mooncake conversation trace
(``kvtier bench trace``; docs/policies.md has the figures), give the two rules:

1. **Reuse predicts reuse.** Most chunks are used once; a chunk that has been hit once is far
   more likely to be hit again (24 % after one use, 42 % after two, 84 % after five). So the
   policy keeps two LRU segments::

        probation   stored, never hit since        (new chunks)
        protected   hit at least once while cached (and ghosts that came back)

   and of the two oldest it evicts the protected one only when it has been idle more than
   ``ratio`` times as long as the probation's. How much longer a reused chunk deserves is
   what the cache's size decides (a small cache must hold on to its few proven chunks; a
   large one holds most first reuses anyway, and old favourites only crowd them out), so
   ``ratio`` is not a constant: it moves until **an evicted new chunk and an evicted reused
   chunk are equally likely to come back**, the balance at which no swap of one victim for
   the other would gain a hit. Each victim leaves a ghost (a key, no bytes) in the list of
   its segment; a ghost that comes back is a miss the other choice would have hit::

        new chunk's ghost returns     log(ratio) -= step x evictions / new evictions
        reused chunk's ghost returns  log(ratio) += step x evictions / reused evictions

   Dividing by each segment's share of evictions (decayed, so the balance follows the load)
   makes the two return *rates* meet, however unequally the two are evicted. ``ratio``
   starts at 2 (the reuse odds after two uses against one, 42 % / 24 %) and stays within
   [1, 64]: a reused chunk never goes before an idler new one.
2. **A prefix is only as good as its parent.** A lookup stops at the first miss, so a child
   kept after its parent is dead weight. A lookup's batch is touched deepest first, so the
   parent ends up the more recent and goes after its children (leaf-first).

Every chunk is admitted. A first reuse is where most hits come from: a doorkeeper that keeps
a chunk only from its second store wins below 5 % capacity on the trace but reaches 0.58 of
the optimum at 10 % (docs/policies.md). A prompt's partial last chunk, the one chunk rarely
reused, is stored only with ``save_unfull_chunk``, when the operator asked for it.
Ghost lists are keys only, each at most as long as the chunks cached.

A held key (:mod:`.base`) keeps its segment and rejoins it as the most recent, idle from
then on. Its segment is what it was, or protected if a lookup hit it while held: a hit is a
reuse, a hold is not (a write in flight holds a new chunk without anyone reusing it). Its
idle time starts when it rejoins because a held chunk is in use until its last holder lets
go (as LRU says, :mod:`.lru`); both segments stay ordered by last use, as the merge in
:meth:`ReusePolicy._victims` needs.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from itertools import repeat

from kvtier.keys import ChunkKey
from kvtier.storage.policy.base import Evictable, EvictionPolicy

# How fast ratio follows the return rates: a step per returning ghost in log space, and the
# decay per eviction of the eviction counts it weighs by (a memory of ~1/(1-decay) victims).
STEP = 0.01
DECAY = 0.999
RATIO_BOUNDS = (1.0, 64.0)


class _Ghosts:
    """Keys recently dropped by one path, oldest first, at most ``len(owner)`` of them."""

    __slots__ = ("_keys",)

    def __init__(self) -> None:
        self._keys: OrderedDict[ChunkKey, None] = OrderedDict()

    def add(self, key: ChunkKey, bound: int) -> None:
        keys = self._keys
        keys[key] = None
        keys.move_to_end(key)
        while len(keys) > bound:
            keys.popitem(last=False)

    def take(self, key: ChunkKey) -> bool:
        """Whether ``key`` was here (it is gone now)."""
        return self._keys.pop(key, 0) is None

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def clear(self) -> None:
        self._keys.clear()


class ReusePolicy(EvictionPolicy):
    name = "REUSE"

    def __init__(self, *, ratio: float = 2.0) -> None:
        """``ratio``: where the idle-time ratio starts (it adapts; see the module docstring)."""
        super().__init__()
        self._log_ratio = math.log(ratio)
        self._probation: OrderedDict[ChunkKey, int] = OrderedDict()  # key -> last use (clock)
        self._protected: OrderedDict[ChunkKey, int] = OrderedDict()
        self._new_ghosts = _Ghosts()  # evicted from probation
        self._reused_ghosts = _Ghosts()  # evicted from protected
        self._new_evictions = 1.0  # decayed counts; 1.0 each so neither weight starts infinite
        self._reused_evictions = 1.0
        self._clock = 0  # one tick per touched batch (a lookup)
        self._held_reused: set[ChunkKey] = set()  # the held keys that rejoin protected

    @property
    def ratio(self) -> float:
        """How many times longer than the oldest new chunk a reused chunk may sit idle."""
        return math.exp(self._log_ratio)

    def admit(self, key: ChunkKey, num_tokens: int) -> bool:
        return True

    def insert(self, key: ChunkKey) -> None:
        total = self._new_evictions + self._reused_evictions
        if self._new_ghosts.take(key):  # a new chunk we dropped came back: keep new ones longer
            self._adapt(-STEP * total / self._new_evictions)
        elif self._reused_ghosts.take(key):  # a reused one came back: keep reused ones longer
            self._adapt(STEP * total / self._reused_evictions)
        else:
            self._probation[key] = self._clock
            return
        self._protected[key] = self._clock  # its second use

    def _adapt(self, delta: float) -> None:
        low, high = RATIO_BOUNDS
        self._log_ratio = min(math.log(high), max(math.log(low), self._log_ratio + delta))

    def touch(self, keys: Sequence[ChunkKey]) -> None:
        self._clock += 1
        held = self._held
        if held and not held.keys().isdisjoint(keys):  # a hit on a held key: reused, held
            self._held_reused.update(k for k in keys if k in held)
            keys = [k for k in keys if k not in held]
        deepest_first = keys[::-1]  # the parent ends most recent: it goes after its children
        # Three C-level passes, no Python per key: out of either segment, into protected's end.
        deque(map(self._probation.pop, deepest_first, repeat(0)), maxlen=0)
        deque(map(self._protected.pop, deepest_first, repeat(0)), maxlen=0)
        self._protected.update(zip(deepest_first, repeat(self._clock)))

    def remove(self, key: ChunkKey) -> None:
        self._probation.pop(key, None)
        self._protected.pop(key, None)
        self._new_ghosts.take(key)
        self._reused_ghosts.take(key)
        self._held.pop(key, None)
        self._held_reused.discard(key)

    def _leave(self, keys: Sequence[ChunkKey]) -> None:
        protected = self._protected
        self._held_reused.update(filter(protected.__contains__, keys))
        deque(map(self._probation.pop, keys, repeat(0)), maxlen=0)  # C-level, as in touch
        deque(map(protected.pop, keys, repeat(0)), maxlen=0)

    def _rejoin(self, key: ChunkKey) -> None:
        reused = key in self._held_reused
        self._held_reused.discard(key)
        (self._protected if reused else self._probation)[key] = self._clock  # see the module

    def _select(self, count: int, evictable: Evictable, refused: list[ChunkKey]) -> list[ChunkKey]:
        victims = self._victims(count, evictable, refused)
        bound = max(len(self) - len(victims), 1)
        for key in victims:
            self._new_evictions *= DECAY
            self._reused_evictions *= DECAY
            if self._probation.pop(key, None) is not None:
                self._new_evictions += 1.0
                self._new_ghosts.add(key, bound)
            else:
                del self._protected[key]
                self._reused_evictions += 1.0
                self._reused_ghosts.add(key, bound)
        return victims

    def _victims(self, count: int, evictable: Evictable, refused: list[ChunkKey]) -> list[ChunkKey]:
        """The next ``count`` victims, merged from the two segments' oldest ends; the keys
        ``evictable`` refused on the way are appended to ``refused``."""
        victims: list[ChunkKey] = []
        new = _candidates(self._probation, evictable, refused)
        old = _candidates(self._protected, evictable, refused)
        a, b = next(new, None), next(old, None)
        now, ratio = self._clock, self.ratio
        while len(victims) < count and (a is not None or b is not None):
            if b is not None and (a is None or now - b[1] > ratio * (now - a[1])):
                victims.append(b[0])
                b = next(old, None)
            elif a is not None:
                victims.append(a[0])
                a = next(new, None)
        return victims

    def order(self) -> Iterator[ChunkKey]:
        in_order = len(self._probation) + len(self._protected)
        return iter([*self._victims(in_order, _any, []), *self._held])

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected) + len(self._held)

    def __contains__(self, key: object) -> bool:
        return key in self._probation or key in self._protected or key in self._held

    def clear(self) -> None:
        self._probation.clear()
        self._protected.clear()
        self._held.clear()
        self._held_reused.clear()
        self._new_ghosts.clear()
        self._reused_ghosts.clear()


def _candidates(
    segment: OrderedDict[ChunkKey, int], evictable: Evictable, refused: list[ChunkKey]
) -> Iterator[tuple[ChunkKey, int]]:
    """(key, last use) of the evictable keys of ``segment``, oldest first, lazily; each
    refused key on the way is appended to ``refused``."""
    for key, stamp in segment.items():
        if evictable(key):
            yield key, stamp
        else:
            refused.append(key)


def _any(_: ChunkKey) -> bool:
    return True
