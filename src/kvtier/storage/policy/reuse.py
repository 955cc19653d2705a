"""``REUSE``: keep what has been reused for as long as it pays, drop children before parents,
and evict by whichever of three rules is winning on the load at hand.

Three observations about prefix caches, each checked on the Mooncake conversation trace and
seven synthetic load shapes (``kvtier bench trace``, ``python -m kvtier.bench.trace_matrix``;
docs/policies.md has the figures), give the design:

1. **Reuse predicts reuse.** Most chunks are used once; a chunk that has been hit once is far
   more likely to be hit again (24 % after one use, 42 % after two, 84 % after five). So the
   policy keeps two LRU segments, probation (stored, never hit since) and protected (hit
   while cached, or stored again soon after it was dropped), and ghosts of what each
   dropped (:mod:`.reuse_segments`).
2. **A prefix is only as good as its parent.** A lookup stops at the first miss, so a child
   kept after its parent is dead weight. A lookup's batch is touched deepest first, so the
   parent ends up the more recent and goes after its children (leaf-first).
3. **No one victim rule wins everywhere.** The idle-time ratio (rule ``reuse``: a protected
   chunk goes only when idle ``ratio`` times longer than the oldest new one, ``ratio``
   adapting to returning ghosts) is best on the conversation trace; ARC's size target for
   probation (rule ``arc``) on a stable Zipf head at small capacity; one LRU order (rule
   ``lru``) on some chat loads. So keys-only shadows of the cache run each rule on a sample
   of the keys, and the cache evicts by the rule whose shadow hits most lately
   (:mod:`.reuse_panel`); before its first eviction (no size known yet) it runs ``reuse``.

Every chunk is admitted. A first reuse is where most hits come from: a doorkeeper that keeps
a chunk only from its second store wins below 5 % capacity on the trace but reaches 0.58 of
the optimum at 10 % (docs/policies.md). A prompt's partial last chunk, the one chunk rarely
reused, is stored only with ``save_unfull_chunk``, when the operator asked for it.

A held key (:mod:`.base`) keeps its segment and rejoins it as the most recent, idle from
then on. Its segment is what it was, or protected if a lookup hit it while held: a hit is a
reuse, a hold is not (a write in flight holds a new chunk without anyone reusing it). Its
idle time starts when it rejoins because a held chunk is in use until its last holder lets
go (as LRU says, :mod:`.lru`); both segments stay ordered by last use, as the merge in
:meth:`~kvtier.storage.policy.reuse_segments.Segments._pick` needs.

Costs: ``touch`` moves a lookup's keys in three C-level passes and hands the shadows the
sampled ones (a C-level filter; a cache above 2 x 8,192 keys samples 1 key in 2-64), which
walk them in Python, three shadows each; an eviction is O(victims) plus the shadows' own.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from itertools import repeat

from kvtier.keys import ChunkKey
from kvtier.storage.policy.base import Evictable, EvictionPolicy
from kvtier.storage.policy.reuse_panel import Panel
from kvtier.storage.policy.reuse_segments import Segments


class ReusePolicy(Segments, EvictionPolicy):
    name = "REUSE"

    def __init__(self, *, ratio: float = 2.0) -> None:
        """``ratio``: where the idle-time ratio starts (it adapts; see the module docstring)."""
        EvictionPolicy.__init__(self)
        Segments.__init__(self, ratio=ratio)
        self._held_reused: set[ChunkKey] = set()  # the held keys that rejoin protected
        self._panel: Panel | None = None  # from the first eviction, when the size is known

    @property
    def panel(self) -> Panel | None:
        """The shadows that choose ``rule`` (None until the first eviction)."""
        return self._panel

    def admit(self, key: ChunkKey, num_tokens: int) -> bool:
        return True

    def insert(self, key: ChunkKey) -> None:
        self._add(key)
        if self._panel is not None:
            self._panel.access((key,))

    def touch(self, keys: Sequence[ChunkKey]) -> None:
        if self._panel is not None:
            self._panel.access(keys)
            self.rule = self._panel.rule
        held = self._held
        if held and not held.keys().isdisjoint(keys):  # a hit on a held key: reused, held
            self._held_reused.update(k for k in keys if k in held)
            keys = [k for k in keys if k not in held]
        self._use(keys)

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
        size = len(self)
        if self._panel is None:
            self._panel = Panel(size)
        else:
            self._panel.resize(size)
        victims = self._pick(count, evictable, refused)
        self._forget(victims, size)
        return victims

    def order(self) -> Iterator[ChunkKey]:
        return iter([*self._in_order(), *self._held])

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected) + len(self._held)

    def __contains__(self, key: object) -> bool:
        return key in self._probation or key in self._protected or key in self._held

    def clear(self) -> None:
        self._clear_segments()
        self._held.clear()
        self._held_reused.clear()
        self._panel = None
