"""Reference caches for a trace replay: the offline optimum, plain LRU, ARC, infinite.

Pure simulations over block ids (no pages, no payloads), measured beside kvtier's real tiers
on the same replay (:func:`replay`): one request at a time, in arrival order::

    lookup(ids)  -> h      the longest cached prefix; those h blocks count as hits (used)
    store(ids, h, tokens)  every block of the prompt not cached is offered to the cache

A block after the first miss is not used even when cached (the lookup stopped before it),
as kvtier's prefix lookup does. Hit ratio = tokens of hit blocks / all prompt tokens.

``Optimum`` is Belady's rule with bypass: the block whose next use is farthest goes (a block
never used again is not kept at all). It is exact under prefix lookup because a block's next
use never precedes its parent's (equal ids mean equal prefixes), and among equal next uses the
deepest block goes first, so it never keeps a child whose parent it dropped.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from kvtier.bench.trace_file import Trace

NEVER = 1 << 62


class ReplayCache(Protocol):
    def lookup(self, ids: Sequence[int]) -> int: ...

    def store(self, ids: Sequence[int], start: int, tokens: Sequence[int]) -> None: ...


def replay(trace: Trace, cache: ReplayCache) -> float:
    """Token hit ratio of ``cache`` over ``trace`` (see the module docstring)."""
    hit = 0
    for ids, tokens in zip(trace.requests, trace.tokens, strict=True):
        h = cache.lookup(ids)
        if h:
            hit += sum(tokens[:h])
        if h < len(ids):
            cache.store(ids, h, tokens)
    return hit / trace.total_tokens


class Infinite:
    def __init__(self) -> None:
        self.blocks: set[int] = set()

    def lookup(self, ids: Sequence[int]) -> int:
        blocks = self.blocks
        for i, b in enumerate(ids):
            if b not in blocks:
                return i
        return len(ids)

    def store(self, ids: Sequence[int], start: int, tokens: Sequence[int]) -> None:
        self.blocks.update(ids[start:])


class Lru:
    """One LRU list, blocks used and stored in prompt order (kvtier's order before policies).
    With ``whole_tokens``, a block of fewer tokens (a partial last block) is never stored."""

    def __init__(self, capacity: int, whole_tokens: int = 0) -> None:
        self.capacity = capacity
        self.whole_tokens = whole_tokens
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def lookup(self, ids: Sequence[int]) -> int:
        blocks = self.blocks
        for i, b in enumerate(ids):
            if b not in blocks:
                return i
            blocks.move_to_end(b)
        return len(ids)

    def store(self, ids: Sequence[int], start: int, tokens: Sequence[int]) -> None:
        blocks, whole = self.blocks, self.whole_tokens
        for b, n in zip(ids[start:], tokens[start:], strict=True):
            if b not in blocks and n >= whole:
                if len(blocks) >= self.capacity:
                    blocks.popitem(last=False)
                blocks[b] = None


class Arc:
    """Adaptive Replacement Cache (Megiddo & Modha, FAST'03): recency list T1, frequency list
    T2, their ghosts B1/B2, and the target size ``p`` of T1 adapted on ghost hits."""

    def __init__(self, capacity: int) -> None:
        self.c = capacity
        self.p = 0.0
        self.t1: OrderedDict[int, None] = OrderedDict()
        self.t2: OrderedDict[int, None] = OrderedDict()
        self.b1: OrderedDict[int, None] = OrderedDict()
        self.b2: OrderedDict[int, None] = OrderedDict()

    def lookup(self, ids: Sequence[int]) -> int:
        t1, t2 = self.t1, self.t2
        for i, b in enumerate(ids):
            if b in t1:
                del t1[b]
                t2[b] = None
            elif b in t2:
                t2.move_to_end(b)
            else:
                return i
        return len(ids)

    def store(self, ids: Sequence[int], start: int, tokens: Sequence[int]) -> None:
        for b in ids[start:]:
            if b not in self.t1 and b not in self.t2:
                self._miss(b)

    def _replace(self, in_b2: bool) -> None:
        t1 = self.t1
        if t1 and (len(t1) > self.p or (in_b2 and len(t1) == self.p)):
            b, _ = t1.popitem(last=False)
            self.b1[b] = None
        elif self.t2:
            b, _ = self.t2.popitem(last=False)
            self.b2[b] = None
        else:
            b, _ = t1.popitem(last=False)
            self.b1[b] = None

    def _miss(self, b: int) -> None:
        c, t1, t2, b1, b2 = self.c, self.t1, self.t2, self.b1, self.b2
        if b in b1:
            self.p = min(float(c), self.p + max(len(b2) / len(b1), 1.0))
            self._replace(False)
            del b1[b]
            t2[b] = None
            return
        if b in b2:
            self.p = max(0.0, self.p - max(len(b1) / len(b2), 1.0))
            self._replace(True)
            del b2[b]
            t2[b] = None
            return
        if len(t1) + len(b1) == c:
            if len(t1) < c:
                b1.popitem(last=False)
                self._replace(False)
            else:
                t1.popitem(last=False)
        elif len(t1) + len(b1) < c:
            total = len(t1) + len(t2) + len(b1) + len(b2)
            if total >= c:
                if total == 2 * c:
                    b2.popitem(last=False)
                self._replace(False)
        t1[b] = None


class Optimum:
    """Belady with bypass over the trace it was built for (replayed in order, once)."""

    def __init__(self, capacity: int, trace: Trace) -> None:
        self.capacity = capacity
        self.next_use = _next_uses(trace.requests)
        self.request = -1
        self.cached: dict[int, int] = {}  # block -> its next use (request index)
        # (-next use, -position in the prompt, block): among equal next uses the deepest block
        # goes first, so a parent never goes before its child. Stale entries are skipped.
        self.heap: list[tuple[int, int, int]] = []

    def lookup(self, ids: Sequence[int]) -> int:
        self.request += 1
        nexts = self.next_use[self.request]
        cached, heap = self.cached, self.heap
        for i, b in enumerate(ids):
            if b not in cached:
                return i
            cached[b] = nexts[i]
            heapq.heappush(heap, (-nexts[i], -i, b))
        return len(ids)

    def store(self, ids: Sequence[int], start: int, tokens: Sequence[int]) -> None:
        nexts = self.next_use[self.request]
        cached, heap = self.cached, self.heap
        for i in range(start, len(ids)):
            b, nxt = ids[i], nexts[i]
            if b in cached:  # cached after the first miss: in this prompt, not used by it
                cached[b] = nxt
                heapq.heappush(heap, (-nxt, -i, b))
                continue
            if nxt == NEVER:
                continue
            if len(cached) >= self.capacity:
                while -heap[0][0] != cached.get(heap[0][2]):
                    heapq.heappop(heap)  # stale: used (or evicted) since it was pushed
                if (-nxt, -i, b) < heap[0]:
                    continue  # everything cached is needed sooner: bypass this one
                victim = heapq.heappop(heap)[2]
                del cached[victim]
            cached[b] = nxt
            heapq.heappush(heap, (-nxt, -i, b))


def _next_uses(requests: list[list[int]]) -> list[list[int]]:
    later: dict[int, int] = {}
    out: list[list[int]] = [[]] * len(requests)
    for r in range(len(requests) - 1, -1, -1):
        ids = requests[r]
        out[r] = [later.get(b, NEVER) for b in ids]
        for b in ids:
            later[b] = r
    return out
