"""The eviction policy contract, run over every policy ``cache_policy`` accepts, then what
each policy promises of its own, and the CPU tier and config driving the seam."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from kvtier.config import Config
from kvtier.config.schema import CACHE_POLICIES
from kvtier.errors import ConfigError
from kvtier.memory.block_pool import BlockPool
from kvtier.storage.cpu import CpuTier
from kvtier.storage.policy import POLICIES, EvictionPolicy, ReusePolicy, make_policy
from tests.storage.tier_contract import CONTRACT_CHUNK, PAGE_BYTES, TOKEN_BYTES, random_key

CHUNK = 16


def keys(n: int) -> list[bytes]:
    return [random_key() for _ in range(n)]


@pytest.fixture(params=sorted(POLICIES))
def policy(request: pytest.FixtureRequest) -> Iterator[EvictionPolicy]:
    yield make_policy(request.param)


class TestPolicyContract:
    def test_inserted_keys_are_known_once_and_removed_ones_forgotten(
        self, policy: EvictionPolicy
    ) -> None:
        ks = keys(6)
        for k in ks:
            assert policy.admit(k, CHUNK)
            policy.insert(k)
        policy.touch(ks[2:4])
        assert len(policy) == 6 and sorted(policy.order()) == sorted(ks)
        policy.remove(ks[0])
        policy.remove(random_key())  # unknown: a no-op
        assert ks[0] not in policy and len(policy) == 5
        policy.clear()
        assert len(policy) == 0 and list(policy.order()) == []

    def test_evict_returns_only_evictable_keys_and_forgets_them(
        self, policy: EvictionPolicy
    ) -> None:
        ks = keys(8)
        for k in ks:
            policy.insert(k)
        pinned = set(ks[::2])
        victims = policy.evict(100, lambda k: k not in pinned)
        assert sorted(victims) == sorted(set(ks) - pinned)
        assert all(v not in policy for v in victims)
        assert policy.evict(3, lambda k: k not in pinned) == []
        assert len(policy.evict(3, lambda k: True)) == 3

    def test_the_next_victims_are_the_head_of_order(self, policy: EvictionPolicy) -> None:
        ks = keys(10)
        for k in ks:
            policy.insert(k)
        policy.touch(ks[3:7])
        expected = list(policy.order())[:4]
        assert policy.evict(4, lambda k: True) == expected

    def test_a_used_key_outlives_an_unused_one_stored_with_it(self, policy: EvictionPolicy) -> None:
        used, unused = keys(2)
        policy.insert(used)
        policy.insert(unused)
        policy.touch([used])
        assert policy.evict(1, lambda k: True) == [unused]

    def test_random_operations_keep_the_key_set_exact(self, policy: EvictionPolicy) -> None:
        rng = random.Random(7)
        model: set[bytes] = set()
        pool = keys(40)
        for _ in range(2000):
            op = rng.randrange(4)
            k = rng.choice(pool)
            if op == 0 and k not in model:
                if policy.admit(k, rng.choice((CHUNK, CHUNK // 2))):
                    policy.insert(k)
                    model.add(k)
            elif op == 1 and model:
                policy.touch(rng.sample(sorted(model), min(len(model), 5)))
            elif op == 2:
                policy.remove(k)
                model.discard(k)
            else:
                keep = frozenset(rng.sample(pool, 10))
                for v in policy.evict(rng.randrange(4), lambda x, keep=keep: x not in keep):
                    assert v in model and v not in keep
                    model.discard(v)
            assert len(policy) == len(model) and set(policy.order()) == model


def test_config_names_are_exactly_the_implemented_policies() -> None:
    assert set(CACHE_POLICIES) == set(POLICIES)


def test_an_unknown_policy_is_refused_naming_key_value_and_choices() -> None:
    with pytest.raises(ConfigError, match=r"cache_policy.*'FIFO'.*LRU.*REUSE"):
        Config.load(env={}, overrides={"cache_policy": "FIFO"})
    with pytest.raises(ConfigError, match=r"cache_policy.*FIFO.*LRU, REUSE"):
        make_policy("FIFO")


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_the_cpu_tier_evicts_by_its_policy_and_never_a_pinned_page(name: str) -> None:
    pool = BlockPool(4, PAGE_BYTES)
    tier = CpuTier(pool, TOKEN_BYTES, make_policy(name))
    ks = keys(4)
    for k in ks:
        (page,) = pool.allocate(1) or []
        assert tier.insert(k, page, CONTRACT_CHUNK)
    pinned = tier.pin_prefix(ks[:2])
    victim = next(k for k in tier.policy.order() if k not in ks[:2])
    assert tier.allocate(1) is not None
    assert not tier.contains([victim])[0] and tier.contains(ks[:2]) == [True, True]
    pool.release(pinned)
    tier.close()
    assert pool.free_pages == pool.num_pages - 1
    pool.close()


# -- REUSE's own rules -----------------------------------------------------------------------
def test_reuse_drops_a_child_before_its_parent() -> None:
    policy = ReusePolicy()
    parent, child = keys(2)
    policy.insert(parent)
    policy.insert(child)
    policy.touch([parent, child])  # one lookup, prompt order
    assert policy.evict(1, lambda k: True) == [child]


def test_reuse_keeps_a_reused_key_ratio_times_longer_idle_than_a_new_one() -> None:
    policy = ReusePolicy(ratio=2.0)
    reused, fresh = keys(2), keys(1)
    for k in reused:
        policy.insert(k)
    policy.touch(reused)  # tick 1
    for _ in range(4):  # four lookups of other prompts: the reused idle 4 ticks
        policy.touch([])
    policy.insert(fresh[0])  # tick 5, idle 0: 4 > 2 x 0, the reused child goes first
    assert policy.evict(1, lambda k: True) == [reused[1]]
    policy.touch([])  # idle: reused 5, fresh 1; 5 > 2 x 1
    assert policy.evict(1, lambda k: True) == [reused[0]]
    other = keys(1)[0]
    policy.insert(other)
    policy.touch([other])  # reused, idle 0 now; fresh idle 1: the new one goes
    assert policy.evict(1, lambda k: True) == fresh


def _evict_and_return(policy: ReusePolicy, reused: bool, rounds: int) -> None:
    """``rounds`` times: a victim of one segment is evicted, then comes back."""
    for _ in range(rounds):
        key = keys(1)[0]
        policy.insert(key)
        if reused:
            policy.touch([key])
            for _ in range(200):  # old enough to go before any new key
                policy.touch([])
        victims = policy.evict(1, lambda k, key=key: k == key)
        assert victims == [key]
        policy.insert(key)  # it comes back: a miss the other choice would have hit
        policy.remove(key)


def test_reuse_keeps_new_keys_longer_when_evicted_new_keys_come_back() -> None:
    policy = ReusePolicy(ratio=2.0)
    _evict_and_return(policy, reused=False, rounds=30)
    assert policy.ratio < 2.0
    _evict_and_return(policy, reused=False, rounds=1000)
    assert policy.ratio == pytest.approx(1.0)  # never below: a reused key never goes first


def test_reuse_keeps_reused_keys_longer_when_evicted_reused_keys_come_back() -> None:
    policy = ReusePolicy(ratio=2.0)
    _evict_and_return(policy, reused=True, rounds=30)
    assert policy.ratio > 2.0
    _evict_and_return(policy, reused=True, rounds=5000)
    assert policy.ratio == pytest.approx(64.0)


def test_reuse_keeps_at_most_as_many_ghosts_of_each_kind_as_keys() -> None:
    policy = ReusePolicy()
    for k in keys(5):
        policy.insert(k)
    for k in keys(40):
        policy.insert(k)
        policy.evict(1, lambda _: True)
    ghosts = (policy._new_ghosts, policy._reused_ghosts)
    assert all(len(g) <= len(policy) for g in ghosts)


class _SecondStoreOnly(ReusePolicy):
    """A doorkeeper: declines a key the first time it is offered."""

    def __init__(self) -> None:
        super().__init__()
        self.offered: set[bytes] = set()

    def admit(self, key: bytes, num_tokens: int) -> bool:
        if key in self.offered:
            return True
        self.offered.add(key)
        return False


def test_the_cpu_tier_keeps_nothing_a_policy_declines_and_the_caller_keeps_its_page() -> None:
    pool = BlockPool(2, PAGE_BYTES)
    tier = CpuTier(pool, TOKEN_BYTES, _SecondStoreOnly())
    key = random_key()
    (page,) = pool.allocate(1) or []
    assert not tier.insert(key, page, CONTRACT_CHUNK)
    assert tier.contains([key]) == [False] and tier.counters.dropped == 1
    assert tier.insert(key, page, CONTRACT_CHUNK)  # the caller's reference, offered again
    assert tier.contains([key]) == [True] and key in tier.policy
    tier.close()
    assert pool.free_pages == pool.num_pages
    pool.close()
