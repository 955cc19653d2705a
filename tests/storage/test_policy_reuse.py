"""``REUSE``'s rules and its panel of shadows (:mod:`kvtier.storage.policy.reuse_segments`,
:mod:`kvtier.storage.policy.reuse_panel`): each rule evicts as it says, the panel picks the
rule whose shadow hits most, a lifecycle that switches rules under pins keeps every key
accounted for, and on synthetic traces ``REUSE`` is never more than 0.002 below LRU or ARC.
Counted in keys and hits, never in wall-clock time."""

from __future__ import annotations

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvtier.bench import trace as trace_bench
from kvtier.bench import trace_sims, trace_synthetic
from kvtier.keys import ChunkKey
from kvtier.storage.policy import ReusePolicy
from kvtier.storage.policy.reuse_panel import SHADOW_KEYS, Panel, Shadow
from kvtier.storage.policy.reuse_segments import NEW_GHOST_SHARE, RULES, Segments, any_key


def key(n: int) -> ChunkKey:
    return n.to_bytes(16, "little")


def test_the_arc_rule_keeps_the_probation_at_its_target() -> None:
    segments = Segments(rule="arc")
    for n in range(4):
        segments._add(key(n))
    segments._use([key(0), key(1)])  # protected: 1, 0 (the parent newest)
    segments._target = 1.0  # probation holds 2, one more than its target
    assert segments._pick(1, any_key, []) == [key(2)]
    segments._target = 2.0  # at its target: the protected's oldest goes
    assert segments._pick(1, any_key, []) == [key(1)]


def test_the_lru_rule_is_one_order_by_last_use() -> None:
    segments = Segments(ratio=64.0, rule="lru")
    segments._add(key(0))
    segments._use([key(0)])  # protected, tick 1
    segments._use([])
    segments._add(key(1))  # probation, tick 2: newer than the reused key
    segments._use([])
    segments._use([])  # idle: the reused key 3 ticks, the new one 2
    assert segments._pick(2, any_key, []) == [key(0), key(1)]
    segments.rule = "reuse"  # the same state by idle-time ratio 64: the new key goes first
    assert segments._pick(2, any_key, []) == [key(1), key(0)]


def _fill_and_evict(segments: Segments, capacity: int, keys: range) -> None:
    for n in keys:
        segments._add(key(n))
        over = segments._segment_size() - capacity
        if over > 0:
            segments._forget(segments._pick(over, any_key, []), capacity)


def test_ghosts_are_at_most_as_many_as_keys_cached() -> None:
    segments = Segments()
    _fill_and_evict(segments, 10, range(200))
    assert len(segments._new_ghosts) <= 10 and len(segments._reused_ghosts) <= 10


@pytest.mark.parametrize(("rule", "promoted"), [("arc", False), ("reuse", True), ("lru", True)])
def test_only_a_ghost_arc_would_hold_is_promoted_under_the_arc_rule(
    rule: str, promoted: bool
) -> None:
    segments = Segments(rule=rule)  # type: ignore[arg-type]
    _fill_and_evict(segments, 10, range(20))  # probation 10..19, new ghosts 1..9 (1 oldest)
    assert segments._arc_ghosts() == (1, 0)  # ARC's B1: capacity - probation, at least 1
    segments._add(key(1))  # an old ghost comes back: 8 ghosts were added after it
    assert (key(1) in segments._protected) is promoted
    segments._add(key(9))  # the newest ghost: a second use to every rule
    assert key(9) in segments._protected


def test_under_the_arc_rule_only_the_newest_share_of_b1_promotes_and_moves_the_target() -> None:
    segments = Segments(rule="arc")
    _fill_and_evict(segments, 20, range(20))  # probation 0..19
    segments._forget(segments._pick(10, any_key, []), 20)  # new ghosts 0..9, 9 the newest
    window = segments._arc_ghosts()[0]  # of ARC's B1 (20 - probation = 10 ghosts)...
    assert window == int(10 * NEW_GHOST_SHARE) < 10  # ...only the newest share counts
    outside = key(9 - window)  # window ghosts were added after it
    segments._add(outside)  # a first use again: probation, the target unmoved
    assert outside in segments._probation and segments.target == 0.0
    window = segments._arc_ghosts()[0]
    inside = key(10 - window)  # the oldest ghost within the (new) window
    segments._add(inside)  # ARC's second use: protected, the target raised
    assert inside in segments._protected and segments.target > 0.0


def test_a_shadow_counts_hits_and_holds_its_capacity() -> None:
    shadow = Shadow("lru")
    shadow.capacity = 3
    shadow.access([key(1), key(2)])
    shadow.access([key(1), key(2), key(3)])
    assert shadow.hits == 2 and shadow._segment_size() == 3
    shadow.access([key(4)])
    assert shadow._segment_size() == 3
    assert key(4) in shadow._probation and key(1) in shadow._protected


def test_the_panel_leaves_lru_on_a_hot_set_under_a_scan() -> None:
    rng = random.Random(0)
    panel = Panel(100)
    hot = [key(n) for n in range(60)]
    scan = iter(range(1000, 10**6))
    for _ in range(20_000):
        if rng.random() < 0.5:
            panel.access([rng.choice(hot)])
        else:
            panel.access([key(next(scan))])
    assert panel.scores["lru"] < min(panel.scores["arc"], panel.scores["reuse"])
    assert panel.rule != "lru"


def test_a_large_cache_samples_its_keys_and_a_small_one_does_not() -> None:
    assert Panel(1000).sampling == 1
    big = Panel(16 * SHADOW_KEYS)
    assert big.sampling == 16 and big.shadows["reuse"].capacity == SHADOW_KEYS
    big.access([key(n) for n in range(256)])  # first bytes 0, 16, 32, ...: sampled
    assert big.shadows["lru"]._segment_size() == 256 // 16


def test_the_policy_starts_its_panel_at_its_first_eviction_and_follows_it() -> None:
    policy = ReusePolicy()
    for n in range(50):
        policy.insert(key(n))
    assert policy.panel is None
    policy.evict(1, any_key)
    panel = policy.panel
    assert panel is not None and panel.shadows["arc"].capacity == 50
    panel.rule = "arc"
    policy.touch([key(10)])
    assert policy.rule == "arc"
    policy.clear()
    assert policy.panel is None and len(policy) == 0


class SwitchingRules(RuleBasedStateMachine):
    """Inserts, lookups, pins and evictions while the rule in use changes: every key the
    policy was given is cached, held or evicted exactly once, and nothing held is a victim."""

    def __init__(self) -> None:
        super().__init__()
        self.policy = ReusePolicy()
        self.cached: set[ChunkKey] = set()
        self.pinned: set[ChunkKey] = set()
        self.next = 0

    @rule(count=st.integers(1, 6))
    def store(self, count: int) -> None:
        for _ in range(count):
            k = key(self.next)
            self.next += 1
            self.policy.insert(k)
            self.cached.add(k)

    @rule(data=st.data())
    def lookup(self, data: st.DataObject) -> None:
        if self.cached:
            ordered = sorted(self.cached)
            start = data.draw(st.integers(0, len(ordered) - 1))
            self.policy.touch(ordered[start : start + data.draw(st.integers(1, 4))])

    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        if self.cached:
            k = data.draw(st.sampled_from(sorted(self.cached)))
            self.pinned.add(k)
            self.policy.hold(k)

    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        if self.pinned:
            k = data.draw(st.sampled_from(sorted(self.pinned)))
            self.pinned.discard(k)
            self.policy.restore(k)

    @rule(count=st.integers(1, 5))
    def evict(self, count: int) -> None:
        victims = self.policy.evict(count, lambda k: k not in self.pinned)
        assert not set(victims) & self.pinned and set(victims) <= self.cached
        assert len(set(victims)) == len(victims)
        assert len(victims) == min(count, len(self.cached - self.pinned))
        self.cached -= set(victims)

    @rule(new=st.sampled_from(RULES))
    def switch(self, new: str) -> None:
        if self.policy.panel is not None:
            self.policy.panel.rule = new  # type: ignore[assignment]
        self.policy.rule = new  # type: ignore[assignment]

    @invariant()
    def every_key_is_accounted_for(self) -> None:
        assert len(self.policy) == len(self.cached)
        assert sorted(self.policy.order()) == sorted(self.cached)


SwitchingRules.TestCase.settings = settings(max_examples=60, stateful_step_count=40)
test_switching_rules_under_pins_keeps_every_key = SwitchingRules.TestCase


# -- the bar on traces: REUSE >= the better of LRU and ARC - 0.002 -----------------
SHORT = 4_000  # requests: a third of each shape, enough for caches to turn over many times


@pytest.mark.parametrize(
    ("shape", "fraction"),
    [("rag-zipf-1.2", 0.02), ("few-shot", 0.05), ("long-chat", 0.01), ("popularity-shift", 0.1)],
)
def test_reuse_is_never_more_than_0_002_below_lru_or_arc(shape: str, fraction: float) -> None:
    tr = trace_synthetic.generate(shape, requests=SHORT)
    blocks = max(1, int(fraction * tr.unique_blocks()))
    reuse = trace_bench.cpu_ratio(tr, blocks, "REUSE")
    lru = trace_sims.replay(tr, trace_sims.Lru(blocks))
    arc = trace_sims.replay(tr, trace_sims.Arc(blocks))
    assert reuse >= max(lru, arc) - 0.002, (shape, fraction, reuse, lru, arc)


@pytest.mark.parametrize(
    ("shape", "fraction"), [("rag-zipf-1.2", 0.01), ("rag-zipf-1.2", 0.02), ("rag-zipf-0.8", 0.05)]
)
def test_on_a_whole_zipf_rag_trace_reuse_is_within_0_002_of_arc(
    shape: str, fraction: float
) -> None:
    """Three of the four points where ``REUSE`` was more than 0.002 below ARC (by 0.0029,
    0.0046 and 0.0025), whole traces: a third of one is too short for the rule to settle."""
    tr = trace_synthetic.generate(shape)
    blocks = max(1, int(fraction * tr.unique_blocks()))
    reuse = trace_bench.cpu_ratio(tr, blocks, "REUSE")
    arc = trace_sims.replay(tr, trace_sims.Arc(blocks))
    assert reuse >= arc - 0.002, (shape, fraction, reuse, arc)
