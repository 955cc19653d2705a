"""The two LRU segments under ``REUSE`` (:mod:`.reuse`), and the three rules that pick a victim
from them; the same code runs the real policy and its keys-only shadows (:mod:`.reuse_panel`).

::

    probation   stored, never hit since        (new chunks)         ghosts: new_ghosts
    protected   hit at least once while cached (and ghosts that came back)  reused_ghosts

Each victim leaves a ghost (a key, no bytes) in its segment's list, at most as many as keys
cached; a ghost that comes back is a miss the other choice would have hit. Two parameters
follow the ghosts all the time, whichever rule is in use, so a rule taken up later starts
from where the load is now:

``ratio`` (rule ``reuse``)
    Of the two oldest, the protected one goes only when it has been idle more than ``ratio``
    times as long as the probation's. A new chunk's ghost coming back lowers it, a reused
    chunk's raises it, each step (:data:`STEP` in log space) weighted by the inverse of its
    segment's share of recent evictions (decayed by :data:`DECAY` per victim); within
    :data:`RATIO_BOUNDS`, starting at 2 (the reuse odds after two uses against one, 42 % /
    24 % on the conversation trace).
``target`` (rule ``arc``)
    ARC's (Megiddo & Modha, FAST'03) target size of the probation segment: the probation's
    oldest goes while the probation holds more than ``target`` keys. A new chunk's ghost
    coming back raises it by max(1, reused ghosts / new ghosts), a reused chunk's lowers it
    by max(1, new ghosts / reused ghosts), within [0, keys cached].

Rule ``lru`` is ``reuse`` at ratio 1: the older of the two oldest goes, one LRU order.

A batch of keys touched by one lookup is moved deepest first, so a parent ends up more
recent than its children and goes after them (a lookup stops at the first miss: a child
kept after its parent is dead weight).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from itertools import repeat
from typing import Literal

from kvtier.keys import ChunkKey
from kvtier.storage.policy.base import Evictable

Rule = Literal["reuse", "arc", "lru"]
RULES: tuple[Rule, ...] = ("reuse", "arc", "lru")

# How fast ratio follows the return rates: a step per returning ghost in log space, and the
# decay per eviction of the eviction counts it weighs by (a memory of ~1/(1-decay) victims).
STEP = 0.01
DECAY = 0.999
RATIO_BOUNDS = (1.0, 64.0)

# The newest share of ARC's B1 (new ghosts) in which a returning ghost counts as ARC's: it
# is promoted and raises ``target``. ARC counts B1 in blocks stored, and the references
# store every prompt's partial last block; kvtier never stores one, so its ghosts age more
# slowly per request and a full-length B1 promotes documents ARC would have forgotten.
# Keys-only, block by block, rag-zipf-1.2 at 2 %: 0.6970 storing every block, 0.6938
# storing whole blocks only, 0.6965 whole blocks with this share at 0.6 (ARC: 0.6965).
NEW_GHOST_SHARE = 0.6


class Ghosts:
    """Keys recently dropped by one segment, oldest first, at most ``bound`` of them, each
    with its place in the list's history (so its age, in ghosts added since, is known)."""

    __slots__ = ("_added", "_keys")

    def __init__(self) -> None:
        self._keys: OrderedDict[ChunkKey, int] = OrderedDict()
        self._added = 0

    def add(self, key: ChunkKey, bound: int) -> None:
        keys = self._keys
        keys.pop(key, None)
        keys[key] = self._added
        self._added += 1
        while len(keys) > bound:
            keys.popitem(last=False)

    def take(self, key: ChunkKey) -> int | None:
        """How many ghosts were added after ``key`` (None: not here); it is gone now."""
        added = self._keys.pop(key, None)
        return None if added is None else self._added - 1 - added

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def clear(self) -> None:
        self._keys.clear()


class Segments:
    """Probation and protected, their ghosts, ``ratio`` and ``target``; victims by ``rule``."""

    def __init__(self, *, ratio: float = 2.0, rule: Rule = "reuse") -> None:
        self.rule: Rule = rule
        self._log_ratio = math.log(ratio)
        self._target = 0.0  # ARC's p: the probation's share it is left to keep
        self._probation: OrderedDict[ChunkKey, int] = OrderedDict()  # key -> last use (clock)
        self._protected: OrderedDict[ChunkKey, int] = OrderedDict()
        self._new_ghosts = Ghosts()  # evicted from probation
        self._reused_ghosts = Ghosts()  # evicted from protected
        self._new_evictions = 1.0  # decayed counts; 1.0 each so neither weight starts infinite
        self._reused_evictions = 1.0
        self._clock = 0  # one tick per touched batch (a lookup)
        self._capacity = 1 << 62  # keys held when it last evicted: unknown before

    @property
    def ratio(self) -> float:
        """How many times longer than the oldest new chunk a reused chunk may sit idle."""
        return math.exp(self._log_ratio)

    @property
    def target(self) -> float:
        """How many keys the ``arc`` rule leaves in probation before it takes protected ones."""
        return self._target

    def _segment_size(self) -> int:
        return len(self._probation) + len(self._protected)

    def _add(self, key: ChunkKey) -> None:
        """``key`` (not here) is stored: into probation, or protected if its ghost came back
        (under rule ``arc`` only a ghost ARC would still hold: see :meth:`_arc_ghosts`)."""
        if key not in self._new_ghosts and key not in self._reused_ghosts:
            self._probation[key] = self._clock  # the common case: a chunk never seen
            return
        arc_new, arc_reused = self._arc_ghosts()
        total = self._new_evictions + self._reused_evictions
        age = self._new_ghosts.take(key)
        if age is not None:  # a new chunk we dropped came back: keep new ones longer
            self._step_ratio(-STEP * total / self._new_evictions)
            in_arc = age < arc_new
            if in_arc:
                self._target = min(
                    self._target + max(1.0, arc_reused / arc_new), float(self._segment_size())
                )
        else:
            age = self._reused_ghosts.take(key) or 0
            self._step_ratio(STEP * total / self._reused_evictions)  # keep reused ones longer
            in_arc = age < arc_reused
            if in_arc:
                self._target = max(self._target - max(1.0, arc_new / max(arc_reused, 1)), 0.0)
        if in_arc or self.rule != "arc":
            self._protected[key] = self._clock  # its second use
        else:
            self._probation[key] = self._clock

    def _arc_ghosts(self) -> tuple[int, int]:
        """How many of each ghost list ARC would hold (the newest): its B1 and B2, bounded
        by probation + B1 <= capacity and B1 + B2 <= capacity, B1 then cut to its newest
        :data:`NEW_GHOST_SHARE`. ARC's shorter memory is what its rule needs (measured:
        0.004-0.006 of hit ratio on Zipf loads at 1 %), the longer one what ``ratio`` needs
        (0.01-0.02 on the conversation trace at 1-2 %)."""
        new = max(min(len(self._new_ghosts), self._capacity - len(self._probation)), 1)
        reused = max(min(len(self._reused_ghosts), self._capacity - new), 0)
        return max(int(new * NEW_GHOST_SHARE), 1), reused  # see NEW_GHOST_SHARE

    def _step_ratio(self, delta: float) -> None:
        low, high = RATIO_BOUNDS
        self._log_ratio = min(math.log(high), max(math.log(low), self._log_ratio + delta))

    def _use(self, keys: Sequence[ChunkKey]) -> None:
        """``keys`` (here) were used by one lookup: to protected's end, deepest first."""
        self._clock += 1
        deepest_first = keys[::-1]  # the parent ends most recent: it goes after its children
        # Three C-level passes, no Python per key: out of either segment, into protected's end.
        deque(map(self._probation.pop, deepest_first, repeat(0)), maxlen=0)
        deque(map(self._protected.pop, deepest_first, repeat(0)), maxlen=0)
        self._protected.update(zip(deepest_first, repeat(self._clock)))

    def _forget(self, victims: Sequence[ChunkKey], capacity: int) -> None:
        """Drop ``victims`` (from ``_pick``) of a cache of ``capacity`` keys, each leaving a
        ghost of its segment; each ghost list holds at most as many keys as the cache."""
        self._capacity = capacity
        bound = max(capacity - len(victims), 1)
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

    def _pick(self, count: int, evictable: Evictable, refused: list[ChunkKey]) -> list[ChunkKey]:
        """The next ``count`` victims by ``rule``, merged from the two segments' oldest ends;
        the keys ``evictable`` refused on the way are appended to ``refused``."""
        victims: list[ChunkKey] = []
        new = _candidates(self._probation, evictable, refused)
        old = _candidates(self._protected, evictable, refused)
        a, b = next(new, None), next(old, None)
        now = self._clock
        ratio = 1.0 if self.rule == "lru" else self.ratio
        by_size, left = self.rule == "arc", len(self._probation) - self._target
        while len(victims) < count and (a is not None or b is not None):
            if by_size:
                take_old = a is None or (b is not None and left <= 0)
            else:
                take_old = b is not None and (a is None or now - b[1] > ratio * (now - a[1]))
            if take_old and b is not None:
                victims.append(b[0])
                b = next(old, None)
            elif a is not None:
                victims.append(a[0])
                a = next(new, None)
                left -= 1
        return victims

    def _in_order(self) -> list[ChunkKey]:
        return self._pick(self._segment_size(), any_key, [])

    def _clear_segments(self) -> None:
        self._probation.clear()
        self._protected.clear()
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


def any_key(_: ChunkKey) -> bool:
    return True
