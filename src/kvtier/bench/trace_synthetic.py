"""Synthetic request traces of seven shapes, for ``kvtier bench trace --synthetic NAME``.

One production trace (Mooncake's conversation trace) cannot say how a policy does on loads
shaped otherwise, so each shape here is a small generative model of one kind of serving load,
written as a :class:`~kvtier.bench.trace_file.Trace` of the same size class as the
conversation trace (12,000 requests, 512-token blocks, a few hundred thousand block accesses)
and the same rules: equal ids mean equal prefixes (ids are chained from block contents by
:func:`~kvtier.bench.trace_file.chain`), and each prompt ends in a partial block of its own
(the new text that no later prompt repeats: a follow-up fills that block with more tokens,
which makes it another block). Every request names its tenant (``Trace.tenants``).

=====================  =======================================================================
name                   the load
=====================  =======================================================================
``rag-zipf-0.8``       a shared system prompt, one document of 4-24 blocks from a corpus of
                       20,000 drawn by Zipf(0.8) popularity, a question
``rag-zipf-1.2``       the same with Zipf(1.2): a hotter head
``agentic``            agent sessions (4 agents' system prompts and tool lists, 6-10 blocks)
                       that loop 3-20 steps, each step re-sending the whole context plus the
                       last tool call and its result (1-4 blocks); 24 sessions at a time
``multi-tenant-scan``  four chat tenants (``t0``-``t3``: own system prompt, conversations of
                       1-10 turns) and one tenant (``scan``) whose 30 % of the requests are
                       documents of 8-32 blocks read once (a batch job scanning a corpus)
``popularity-shift``   RAG with Zipf(1.0) whose popular documents change every 2,000 requests
``few-shot``           300 few-shot templates (4-16 blocks, Zipf(1.0)) each followed by its
                       query, and 30 % one-off prompts of 4-30 blocks
``long-chat``          64 conversations at a time of 3-24 turns (1-3 blocks a turn); 40 % of
                       the conversations that go quiet come back 500-6,000 requests later
                       and go on where they stopped
=====================  =======================================================================

Given a name and a seed the trace is the same on every machine (``random.Random(seed)`` only,
no hash of a string); the default seed of each shape is :data:`SEEDS`.
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import json
import random
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import accumulate

from kvtier.bench.trace_file import Trace, chain
from kvtier.errors import InputError

BLOCK_TOKENS = 512
REQUESTS = 12_000


@dataclass(slots=True)
class _Rows:
    """The trace under construction: block contents (chained at the end) and tenants."""

    rng: random.Random
    requests: int = REQUESTS
    contents: list[list[int]] = field(default_factory=list)
    tails: list[int] = field(default_factory=list)  # tokens of each prompt's last block
    tenants: list[str] = field(default_factory=list)
    _next_id: int = 0

    def fresh(self, count: int) -> list[int]:
        """``count`` block contents nobody has used."""
        start = self._next_id
        self._next_id += count
        return list(range(start, start + count))

    def emit(self, context: list[int], tenant: str) -> None:
        """A prompt: ``context`` (whole blocks) and a partial block of new text."""
        self.contents.append([*context, *self.fresh(1)])
        self.tails.append(self.rng.randint(1, BLOCK_TOKENS - 1))
        self.tenants.append(tenant)

    def trace(self) -> Trace:
        pairs = zip(self.contents, self.tails, strict=True)
        tokens = [[BLOCK_TOKENS] * (len(c) - 1) + [t] for c, t in pairs]
        return Trace(chain(self.contents), tokens, BLOCK_TOKENS, self.tenants)


class _Zipf:
    """Draws ranks 0..n-1 with probability proportional to 1 / (rank + 1) ** s."""

    def __init__(self, n: int, s: float) -> None:
        self._cum = list(accumulate(1.0 / (r + 1) ** s for r in range(n)))

    def draw(self, rng: random.Random) -> int:
        return min(bisect.bisect(self._cum, rng.random() * self._cum[-1]), len(self._cum) - 1)


def _corpus(rows: _Rows, count: int, low: int, high: int) -> list[list[int]]:
    return [rows.fresh(rows.rng.randint(low, high)) for _ in range(count)]


def _rag(rows: _Rows, s: float, shift_every: int = 0) -> None:
    rng = rows.rng
    system = rows.fresh(2)
    docs = _corpus(rows, 20_000, 4, 24)
    zipf = _Zipf(len(docs), s)
    rank_to_doc = list(range(len(docs)))
    for n in range(rows.requests):
        if shift_every and n % shift_every == 0:
            rng.shuffle(rank_to_doc)  # a new set of popular documents
        rows.emit(system + docs[rank_to_doc[zipf.draw(rng)]], "rag")


def _agentic(rows: _Rows) -> None:
    rng = rows.rng
    agents = _corpus(rows, 4, 6, 10)
    agent_pick = _Zipf(len(agents), 1.0)

    def session() -> tuple[list[int], int]:
        return agents[agent_pick.draw(rng)] + rows.fresh(rng.randint(1, 3)), rng.randint(3, 20)

    active = [session() for _ in range(24)]
    for _ in range(rows.requests):
        i = rng.randrange(len(active))
        context, steps = active[i]
        rows.emit(context, "agent")
        context = context + rows.fresh(rng.randint(1, 4))  # the tool call and its result
        active[i] = (context, steps - 1) if steps > 1 else session()


def _chat_turn(rows: _Rows, context: list[int], low: int, high: int) -> list[int]:
    """The next turn's context: the reply and the next message appended."""
    return context + rows.fresh(rows.rng.randint(low, high))


def _multi_tenant_scan(rows: _Rows) -> None:
    rng = rows.rng
    tenants = [f"t{i}" for i in range(4)]
    systems = {t: rows.fresh(rng.randint(2, 4)) for t in tenants}
    scan_system = rows.fresh(1)

    def conversation(tenant: str) -> tuple[list[int], int]:
        return systems[tenant] + rows.fresh(rng.randint(1, 3)), rng.randint(1, 10)

    active = {t: [conversation(t) for _ in range(16)] for t in tenants}
    for _ in range(rows.requests):
        if rng.random() < 0.3:
            rows.emit(scan_system + rows.fresh(rng.randint(8, 32)), "scan")
            continue
        tenant = tenants[rng.randrange(len(tenants))]
        pool = active[tenant]
        i = rng.randrange(len(pool))
        context, turns = pool[i]
        rows.emit(context, tenant)
        nxt = _chat_turn(rows, context, 1, 3)
        pool[i] = (nxt, turns - 1) if turns > 1 else conversation(tenant)


def _few_shot(rows: _Rows) -> None:
    rng = rows.rng
    templates = _corpus(rows, 300, 4, 16)
    pick = _Zipf(len(templates), 1.0)
    for _ in range(rows.requests):
        if rng.random() < 0.3:
            rows.emit(rows.fresh(rng.randint(4, 30)), "one-off")
        else:
            rows.emit(templates[pick.draw(rng)] + rows.fresh(rng.randint(0, 1)), "few-shot")


def _long_chat(rows: _Rows) -> None:
    rng = rows.rng
    systems = _corpus(rows, 3, 2, 2)

    def conversation() -> tuple[list[int], int]:
        return systems[rng.randrange(len(systems))] + rows.fresh(rng.randint(1, 3)), rng.randint(
            3, 24
        )

    active = [conversation() for _ in range(64)]
    dormant: list[tuple[int, int, list[int]]] = []  # (wakes at request, tie-break, context)
    for n in range(rows.requests):
        if dormant and dormant[0][0] <= n:  # a quiet conversation comes back
            _, _, context = heapq.heappop(dormant)
            active.append((context, rng.randint(3, 24)))
        i = rng.randrange(len(active))
        context, turns = active[i]
        rows.emit(context, "chat")
        context = _chat_turn(rows, context, 1, 3)
        if turns > 1:
            active[i] = (context, turns - 1)
            continue
        if rng.random() < 0.4:
            heapq.heappush(dormant, (n + rng.randint(500, 6_000), n, context))
        if len(active) > 64 or rng.random() < 0.5:  # keep about 64 going
            active.pop(i)
            if len(active) < 64:
                active.append(conversation())
        else:
            active[i] = conversation()


SHAPES: dict[str, Callable[[_Rows], None]] = {
    "rag-zipf-0.8": lambda rows: _rag(rows, 0.8),
    "rag-zipf-1.2": lambda rows: _rag(rows, 1.2),
    "agentic": _agentic,
    "multi-tenant-scan": _multi_tenant_scan,
    "popularity-shift": lambda rows: _rag(rows, 1.0, shift_every=2_000),
    "few-shot": _few_shot,
    "long-chat": _long_chat,
}
# Fixed per shape, so a figure quoted for a shape names one trace.
SEEDS: dict[str, int] = {name: 49 + i for i, name in enumerate(SHAPES)}


def generate(name: str, seed: int | None = None, requests: int = REQUESTS) -> Trace:
    """The trace of shape ``name`` (a :data:`SHAPES` key) drawn with ``seed`` (default: the
    shape's :data:`SEEDS` entry); ``requests`` shortens it (for tests)."""
    try:
        shape = SHAPES[name]
    except KeyError:
        raise InputError(
            f"--synthetic {name!r} is not a shape; valid: {', '.join(SHAPES)}"
        ) from None
    rows = _Rows(random.Random(SEEDS[name] if seed is None else seed), requests)
    shape(rows)
    return rows.trace()


def jsonl(trace: Trace) -> Iterator[str]:
    """``trace`` as lines of the Mooncake format, each with its ``tenant``."""
    tenants = trace.tenants or [""] * len(trace.requests)
    for ids, tokens, tenant in zip(trace.requests, trace.tokens, tenants, strict=True):
        row = {"input_length": sum(tokens), "hash_ids": ids, "tenant": tenant}
        yield json.dumps(row, separators=(",", ":"))


def main(argv: list[str] | None = None) -> int:
    """``python -m kvtier.bench.trace_synthetic NAME [--seed N]``: the trace as JSONL on
    stdout (to replay it elsewhere, or to read it)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", choices=sorted(SHAPES))
    parser.add_argument("--seed", type=int, default=None, help="default: the shape's own")
    args = parser.parse_args(argv)
    try:
        for line in jsonl(generate(args.name, args.seed)):
            sys.stdout.write(line + "\n")
    except BrokenPipeError:  # the reader had enough (``| head``): not an error
        sys.stderr.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
