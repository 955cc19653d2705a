"""Which rule ``REUSE`` evicts by: keys-only shadows of the cache, one per rule, on a sample.

No one victim rule wins on every load (docs/policies.md: the idle-time ``ratio`` of ``reuse``
is best on the conversation trace, ARC's size target on a stable Zipf head at small
capacity, one LRU order where neither frequency nor idle time tells the future). So
``REUSE`` runs each rule on a shadow (:class:`Shadow`: the same :class:`Segments`, keys only,
no bytes) and evicts by the rule whose shadow hit most lately::

    the real cache's events      touch(keys)  insert(key)          (every lookup, every store)
            │ keys whose first byte is 0 mod M (a 1/M sample of a uniform hash)
            ▼
    shadow reuse │ shadow arc │ shadow lru      each holding capacity / M keys, counting hits
            │ every window of sampled accesses: score = 23/24 score + hits
            ▼
    the real cache's rule = the best score (kept unless beaten by HYSTERESIS)

Sampling keeps the cost small and bounded: M is the power of two (at most 64) that leaves a
shadow about :data:`SHADOW_KEYS` keys, so a large cache pays for 1/M of its keys three
times, a small one (where a sample would be too noisy) for all of them. The shadows start at
the real cache's first eviction (before it, every rule keeps everything: nothing to choose)
and follow its size at every eviction. A shadow counts a hit per key, not per prefix (it
sees keys, not prompts): all three are measured the same way, so the comparison holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress
from operator import itemgetter

from kvtier.keys import ChunkKey
from kvtier.storage.policy.reuse_segments import RULES, Rule, Segments, any_key

SHADOW_KEYS = 8192  # keys a shadow holds when the cache is large enough to sample
MAX_SAMPLING = 64  # at most 1 key in 64 (the sample is a key's first byte mod M)
HYSTERESIS = 0.005  # a rule takes over when its score beats the one in use by 0.5 %
# A score's decay per window: it weighs about the last 24 windows. At 63/64 the panel left
# rule reuse on rag-zipf-1.2 at 2 % at request 5,378 of 12,000 (now 4,070), 0.0044 behind
# ARC by then; at 15/16 it flips on close scores every few windows (long-chat at 1 %:
# -0.010). docs/policies.md has the figures.
MEMORY = 23 / 24
_FIRST_BYTE = itemgetter(0)


class Shadow(Segments):
    """A keys-only cache of ``capacity`` keys run by one rule, counting its hits."""

    def __init__(self, rule: Rule) -> None:
        super().__init__(rule=rule)
        self.capacity = 1
        self.hits = 0

    def access(self, keys: Sequence[ChunkKey]) -> None:
        """One lookup's keys (or one stored key): hits where held, stored where not."""
        probation, protected = self._probation, self._protected
        if len(keys) == 1:  # a store: the common call, without the batch's lists
            key = keys[0]
            if key in probation or key in protected:
                self.hits += 1
                self._use(keys)
                return
            self._add(key)
            if self._segment_size() > self.capacity:
                self._forget([self._first_victim()], self.capacity)
            return
        held = [k for k in keys if k in probation or k in protected]
        self.hits += len(held)
        if held:
            self._use(held)
        if len(held) < len(keys):
            for key in keys:
                if key not in probation and key not in protected:
                    self._add(key)
            self.trim()

    def trim(self) -> None:
        over = self._segment_size() - self.capacity
        if over == 1:
            self._forget([self._first_victim()], self.capacity)
        elif over > 0:
            self._forget(self._pick(over, any_key, []), self.capacity)

    def _first_victim(self) -> ChunkKey:
        """``_pick(1, ...)`` without its generators: a shadow refuses no key."""
        probation, protected = self._probation, self._protected
        if not protected:
            return next(iter(probation))
        if not probation:
            return next(iter(protected))
        new_key, new_used = next(iter(probation.items()))
        old_key, old_used = next(iter(protected.items()))
        if self.rule == "arc":
            return new_key if len(probation) > self._target else old_key
        ratio = 1.0 if self.rule == "lru" else self.ratio
        now = self._clock
        return old_key if now - old_used > ratio * (now - new_used) else new_key


class Panel:
    """The three shadows, their scores, and the rule in use."""

    def __init__(self, capacity: int) -> None:
        sampling = 1
        while sampling < MAX_SAMPLING and capacity // (2 * sampling) >= SHADOW_KEYS:
            sampling *= 2
        self.sampling = sampling
        self._sampled = frozenset(range(0, 256, sampling)).__contains__
        self.shadows = {rule: Shadow(rule) for rule in RULES}
        self.scores = dict.fromkeys(RULES, 0.0)
        self.rule: Rule = "reuse"
        self._accesses = 0
        self.resize(capacity)

    def resize(self, capacity: int) -> None:
        """The real cache holds ``capacity`` keys (seen when it evicts)."""
        per_shadow = max(1, capacity // self.sampling)
        self._window = max(1024, per_shadow)
        for shadow in self.shadows.values():
            if shadow.capacity != per_shadow:
                shadow.capacity = per_shadow
                shadow.trim()

    def access(self, keys: Sequence[ChunkKey]) -> None:
        """The real cache's keys of one lookup, or one stored key."""
        if self.sampling > 1:  # C-level: no Python per key of the real cache
            keys = list(compress(keys, map(self._sampled, map(_FIRST_BYTE, keys))))
            if not keys:
                return
        for shadow in self.shadows.values():
            shadow.access(keys)
        self._accesses += len(keys)
        if self._accesses >= self._window:
            self._accesses = 0
            self._score()

    def _score(self) -> None:
        scores = self.scores
        for rule, shadow in self.shadows.items():
            scores[rule] = scores[rule] * MEMORY + shadow.hits
            shadow.hits = 0
        best = max(RULES, key=scores.__getitem__)
        if scores[best] > scores[self.rule] * (1 + HYSTERESIS) + 1:
            self.rule = best
