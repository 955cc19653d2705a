"""REUSE (the default ``cache_policy``) on three loads that break a plain LRU order, through a
real Engine and its CPU tier of 16 chunks: a hot set going cold (the new hot set must take
over at once), and a hot set under a flood of one-shot prompts or under a cyclic scan larger
than the cache (the hot set must keep hitting). LRU runs the same loads as the control: it
loses the hot set under both, which shows each load does what it is meant to."""

from __future__ import annotations

import pytest

from kvtier import Engine
from tests.conftest import SMALL_CHUNK, SMALL_LAYOUT, make_kv, small_config

CAPACITY = 16  # chunks
HOT = list(range(8))  # half the cache
KV = make_kv(SMALL_CHUNK, seed=5)


def prompt(i: int) -> list[int]:
    """One chunk, its own from the first token."""
    return [1 + i % 30_000, 2 + i // 30_000] + [7] * (SMALL_CHUNK - 2)


def replay(policy: str, accesses: list[int]) -> list[bool]:
    """Each access a request: a lookup, and a store of the chunk where it missed."""
    engine = Engine(
        small_config(cpu_chunks=CAPACITY, cache_policy=policy), SMALL_LAYOUT, model_name="loads"
    ).open()
    hits = []
    try:
        for n, i in enumerate(accesses):
            with engine.request(f"r{n}"):
                hit = engine.lookup(prompt(i), f"r{n}").tokens == SMALL_CHUNK
            hits.append(hit)
            if not hit:
                engine.store(prompt(i), KV)
        assert engine.check_invariants() == [] and engine.leaks() == []
    finally:
        engine.close()
    return hits


def hot_set_then(between: list[int], rounds: int = 30) -> list[int]:
    """The hot set reused alone for 5 rounds (it is hit: proven reuse), then ``rounds``
    rounds of the hot set, each hot prompt followed by an equal share of ``between``."""
    accesses = HOT * 5
    others = iter(between)
    per_gap = len(between) // (rounds * len(HOT))
    for _ in range(rounds):
        for hot in HOT:
            accesses.append(hot)
            accesses.extend(next(others) for _ in range(per_gap))
    return accesses


def last_third_hot_hits(accesses: list[int], hits: list[bool]) -> tuple[int, int]:
    hot = [hit for i, hit in zip(accesses, hits, strict=True) if i in HOT]
    tail = hot[-len(hot) // 3 :]
    return sum(tail), len(tail)


@pytest.mark.parametrize(
    "others",
    [
        pytest.param([10_000 + n for n in range(30 * 8 * 5)], id="one-shot-flood"),
        pytest.param([20_000 + n % 40 for n in range(30 * 8 * 5)], id="cyclic-scan-of-40"),
    ],
)
def test_a_proven_hot_set_keeps_hitting_through_what_lru_is_flushed_by(
    others: list[int],
) -> None:
    """40 other prompts between two uses of a hot prompt (2.5 caches full): LRU has flushed
    it each time; REUSE keeps the hot set (proven by its hits) and evicts the others."""
    accesses = hot_set_then(others)
    got, out_of = last_third_hot_hits(accesses, replay("REUSE", accesses))
    assert got == out_of, f"REUSE hit the hot set {got} times of {out_of}"
    assert last_third_hot_hits(accesses, replay("LRU", accesses))[0] == 0  # the control


def test_a_hot_set_going_cold_gives_way_to_the_new_one_at_once() -> None:
    """40 rounds of hot set A (with 3 one-shot prompts each), then 40 of hot set B: each of
    B's prompts misses only at its first use (A's proven chunks do not squat the cache)."""
    accesses: list[int] = []
    for start, one_shots in ((0, 1000), (100, 5000)):
        for r in range(40):
            accesses += [start + k for k in range(len(HOT))]
            accesses += [one_shots + 3 * r + k for k in range(3)]
    hits = replay("REUSE", accesses)
    second_hot = [hit for i, hit in zip(accesses, hits, strict=True) if 100 <= i < 108]
    assert second_hot.count(False) == len(HOT)  # one first-use miss each, nothing more
