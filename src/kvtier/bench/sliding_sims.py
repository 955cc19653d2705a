"""Which sliding-window records to keep: three ways, replayed on a trace in equal bytes.

A model with sliding-window layers (Gemma-3: 5 local layers of window 1024 to 1 global;
gpt-oss: 1 to 1, window 128) needs, for a request resuming at token ``p``, every token
before ``p`` of its full layers but only the last ``keep`` tokens of its sliding layers
(:func:`kvtier.layout.sliding_keep`). What is stored decides both the bytes a token costs
and where a later request may resume::

    policy     a chunk's record holds                      a hit may end at
    every      every layer, every token (kvtier when a      any chunk end
               config sets a chunk <= keep)
    chunk G    full layers: G tokens; sliding: the last     a multiple of G
               min(G, keep) tokens (one chunk of G)
    chunk G+   as chunk G, and each prompt's tail to its    a multiple of G, or a
    checkpoints last whole block as one more record         prompt's last whole block
               (kvtier's default, G = 4 x keep)
    anchors    lean (full layers only), except the          a chunk end whose last keep
               chunks within keep before an anchor:         tokens are whole: the anchors
               whole (every layer)                          (a prompt's end; where a prompt
                                                            left the cached prefix)
    groups     two records per chunk: its full layers'      a chunk end whose last keep
               part and its sliding part, one LRU; a hit    tokens' sliding parts are
               uses the sliding parts of its window only    still held
    groups+    as groups, but a sliding part goes in at     as groups
    anchors    the cold end of the LRU unless its chunk
               is within keep before an anchor

Bytes are counted in units of one token of every layer (a full-attention record's token):
a lean token costs ``1 - s``, with ``s`` the sliding layers' share of the KV. Records live
in one LRU of a fixed number of bytes; a whole and a lean record of the same chunk are two
records (the lean one is stored only where no whole one is). ``groups`` is how vLLM's and
SGLang's own sliding-window caches evict (a sliding block nobody resumes behind is freed
first); ``groups+anchors`` adds the anchors' guess of where a later request will resume.

Positions are the trace's blocks (its finest grain, 512 tokens in Mooncake's): the chunk of
``every`` and ``anchors`` is one block, ``chunk G`` takes G / block blocks. Only whole
blocks are stored (a prompt's partial last block never is) and a hit never covers a
prompt's last token, for every policy alike.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import cast

from kvtier.bench.trace_file import Trace


@dataclass(frozen=True, slots=True)
class SlidingModel:
    """``share``: the sliding layers' part of a token's KV (5/6 for Gemma-3's 5:1);
    ``keep``: tokens before a resume its sliding layers need."""

    share: float
    keep: int

    def lean(self, tokens: int) -> float:
        return (1 - self.share) * tokens

    def whole(self, tokens: int) -> float:
        """A chunk of ``tokens`` whose sliding part keeps its last ``keep`` tokens."""
        return self.lean(tokens) + self.share * min(tokens, self.keep)


class ByteLru:
    """Records by name and size in one byte budget, least recently used out first."""

    def __init__(self, capacity: float) -> None:
        self.capacity = capacity
        self.used = 0.0
        self.sizes: OrderedDict[object, float] = OrderedDict()
        self.stored = 0.0  # every byte ever inserted (bytes per token stored)

    def __contains__(self, name: object) -> bool:
        return name in self.sizes

    def touch(self, name: object) -> None:
        self.sizes.move_to_end(name)

    def insert(self, name: object, size: float) -> bool:
        if name in self.sizes or size > self.capacity:
            return False
        while self.used + size > self.capacity:
            _, gone = self.sizes.popitem(last=False)
            self.used -= gone
        self.sizes[name] = size
        self.used += size
        self.stored += size
        return True


class Policy:
    """One way to keep a sliding model's records (see the module docstring)."""

    name = ""

    def __init__(self, model: SlidingModel, block: int, capacity: float) -> None:
        self.model = model
        self.block = block
        self.lru = ByteLru(capacity)
        self.covered = 0  # tokens of the chunks stored (a chunk stored again: once more)

    def request(self, ids: Sequence[int], tokens: int) -> int:
        """Look ``ids`` up (their records used), then store what the request computed;
        the tokens the hit reused."""
        raise NotImplementedError

    def held_tokens(self) -> int:
        """Tokens whose chunk the cache holds now, in any form."""
        return len(self.lru.sizes) * self.block


class Every(Policy):
    name = "every"

    def request(self, ids: Sequence[int], tokens: int) -> int:
        lru, whole = self.lru, tokens // self.block
        n = 0
        limit = (tokens - 1) // self.block
        while n < limit and ids[n] in lru:
            lru.touch(ids[n])
            n += 1
        for i in range(n, whole):
            self.covered += self.block * lru.insert(ids[i], float(self.block))
        return n * self.block


class Grid(Policy):
    """Chunks of ``blocks`` trace blocks, each keyed by its last block's id."""

    def __init__(self, model: SlidingModel, block: int, capacity: float, blocks: int) -> None:
        super().__init__(model, block, capacity)
        self.blocks = blocks
        self.name = f"chunk {blocks * block}"

    def request(self, ids: Sequence[int], tokens: int) -> int:
        lru, size = self.lru, self.blocks * self.block
        limit = (tokens - 1) // size
        n = 0
        while n < limit and ids[(n + 1) * self.blocks - 1] in lru:
            lru.touch(ids[(n + 1) * self.blocks - 1])
            n += 1
        record = self.model.whole(size)
        for i in range(n, tokens // size):
            self.covered += size * lru.insert(ids[(i + 1) * self.blocks - 1], record)
        return n * size

    def held_tokens(self) -> int:
        return len(self.lru.sizes) * self.blocks * self.block


class _Windowed(Policy):
    """A policy that resumes only where the window's sliding parts are held."""

    @property
    def window(self) -> int:
        """Chunks before a resume whose sliding part it needs."""
        return -(-self.model.keep // self.block)

    def _resume(self, ids: Sequence[int], n: int, sliding: Callable[[int], bool]) -> int:
        """The last chunk end at or before ``n`` whose window's sliding parts are held."""
        p, w = n, self.window
        while p and not all(sliding(j) for j in range(max(0, p - w), p)):
            p -= 1
        return p

    def _marked(self, n: int, tokens: int) -> set[int]:
        """Chunks within the window before an anchor: the prompt's last whole chunk end,
        its last resumable one, and where it left the cached prefix (``n``)."""
        limit, w = (tokens - 1) // self.block, self.window
        return {
            j for a in {tokens // self.block, limit, n} if a > 0 for j in range(max(0, a - w), a)
        }

    def held_tokens(self) -> int:
        """Chunks held in any form: a whole record, a lean one, or a full layers' part."""
        names = cast("Iterable[tuple[str, int]]", self.lru.sizes)
        return len({chunk for kind, chunk in names if kind != "s"}) * self.block


class Anchors(_Windowed):
    name = "anchors"

    def request(self, ids: Sequence[int], tokens: int) -> int:
        lru = self.lru
        limit = (tokens - 1) // self.block
        n = 0  # chunks held in either form: where this prompt leaves the cached prefix
        while n < limit and (("w", ids[n]) in lru or ("l", ids[n]) in lru):
            n += 1
        p = self._resume(ids, n, lambda j: ("w", ids[j]) in lru)
        for j in range(p):
            inside = j >= p - self.window
            name = ("w", ids[j]) if inside or ("l", ids[j]) not in lru else ("l", ids[j])
            lru.touch(name)
        marked = self._marked(n, tokens)
        lean, full = self.model.lean(self.block), self.model.whole(self.block)
        for j in range(p, tokens // self.block):
            if j in marked:
                # A lean copy already held: the whole one adds bytes, not tokens.
                known = ("l", ids[j]) in lru
                self.covered += self.block * (lru.insert(("w", ids[j]), full) and not known)
            elif ("w", ids[j]) not in lru:
                self.covered += self.block * lru.insert(("l", ids[j]), lean)
        return p * self.block


class Groups(_Windowed):
    """Per-group records in one LRU: every chunk stores its full part and its sliding part
    as two records; a hit uses (touches) the full parts before it and the sliding parts of
    its window only, so sliding parts nobody resumes behind age out first (vLLM's and
    SGLang's sliding-window caches evict this way)."""

    name = "groups"
    cold = False  # sliding parts outside an anchor's window go in at the LRU's cold end

    def request(self, ids: Sequence[int], tokens: int) -> int:
        lru = self.lru
        limit = (tokens - 1) // self.block
        n = 0
        while n < limit and ("f", ids[n]) in lru:
            n += 1
        p = self._resume(ids, n, lambda j: ("s", ids[j]) in lru)
        for j in range(p):
            lru.touch(("f", ids[j]))
        for j in range(max(0, p - self.window), p):
            lru.touch(("s", ids[j]))
        lean = self.model.lean(self.block)
        sliding = self.model.whole(self.block) - lean
        whole = range(p, tokens // self.block)
        for j in whole:
            self.covered += self.block * lru.insert(("f", ids[j]), lean)
        marked = self._marked(n, tokens) if self.cold else set(whole)
        for j in sorted(marked):
            if j >= p or ("s", ids[j]) not in lru:
                lru.insert(("s", ids[j]), sliding)
        for j in whole:
            if j not in marked and lru.insert(("s", ids[j]), sliding):
                lru.sizes.move_to_end(("s", ids[j]), last=False)
        return p * self.block


class ColdGroups(Groups):
    """``groups``, but a chunk's sliding part goes in at the cold end of the LRU unless the
    chunk is within the window before an anchor (as ``anchors`` marks them): the parts a
    later resume is likely to need stay, the others only fill spare room."""

    name = "groups+anchors"
    cold = True


@dataclass(frozen=True, slots=True)
class Outcome:
    policy: str
    hit_ratio: float  # tokens reused / prompt tokens
    stored_per_token: float  # bytes inserted / tokens their chunks cover, in token units
    held_per_token: float  # bytes held at the end / tokens whose chunk is held


def replay(trace: Trace, policy: Policy) -> Outcome:
    hit = total = 0
    for ids, tokens in zip(trace.requests, trace.tokens, strict=True):
        length = sum(tokens)
        hit += policy.request(ids, length)
        total += length
    stored = policy.lru.stored / policy.covered if policy.covered else 0.0
    held = policy.held_tokens()
    return Outcome(
        policy.name,
        hit / total if total else 0.0,
        stored,
        policy.lru.used / held if held else 0.0,
    )


class GridCheckpoints(Grid):
    """``chunk G`` plus a checkpoint at each prompt's end (kvtier's records for a sliding
    model, :mod:`kvtier.integrations.vllm.checkpoints`): a partial chunk record of the prompt's
    tokens up to its last whole block, keyed by that prefix. A hit is the longest held prefix
    ending at a whole chunk's end or at a checkpoint in the first chunk it misses. A
    checkpoint costs a whole chunk's record, as a page of kvtier's CPU tier does (disk and
    Redis store only its bytes: a little more fits there)."""

    def __init__(self, model: SlidingModel, block: int, capacity: float, blocks: int) -> None:
        super().__init__(model, block, capacity, blocks)
        self.name = f"chunk {blocks * block}+checkpoints"

    def request(self, ids: Sequence[int], tokens: int) -> int:
        lru, b = self.lru, self.blocks
        size = b * self.block
        record = self.model.whole(size)
        last = (tokens - 1) // self.block  # blocks a hit may cover
        n = 0
        while (n + 1) * b <= last and ("g", ids[(n + 1) * b - 1]) in lru:
            lru.touch(("g", ids[(n + 1) * b - 1]))
            n += 1
        hit = n * b
        for k in range(min((n + 1) * b - 1, last), n * b, -1):
            if ("c", ids[k - 1]) in lru:
                lru.touch(("c", ids[k - 1]))
                hit = k
                break
        for i in range(n, tokens // size):
            self.covered += size * lru.insert(("g", ids[(i + 1) * b - 1]), record)
        end = tokens // self.block  # the prompt's last whole block
        if end % b and end > hit:
            new = (end - max(hit, end - end % b)) * self.block  # tokens no record held
            self.covered += new * lru.insert(("c", ids[end - 1]), record)
        return hit * self.block

    def held_tokens(self) -> int:
        """Tokens of the whole chunks held (a checkpoint adds bytes, not chunks)."""
        names = cast("Iterable[tuple[str, int]]", self.lru.sizes)
        return sum(1 for kind, _ in names if kind == "g") * self.blocks * self.block
