from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvtier.memory.block_pool import BlockPool
from kvtier.storage.cpu import CpuTier
from tests.storage.tier_contract import (
    CONTRACT_CHUNK,
    PAGE_BYTES,
    TOKEN_BYTES,
    TierContract,
    random_key,
)


class TestCpuTierContract(TierContract):
    @pytest.fixture
    def tier(self) -> Iterator[CpuTier]:
        pool = BlockPool(16, PAGE_BYTES)
        tier = CpuTier(pool, TOKEN_BYTES)
        tier.open()
        yield tier
        tier.close()
        assert pool.free_pages == pool.num_pages
        pool.close()


@pytest.fixture
def pool() -> Iterator[BlockPool]:
    pool = BlockPool(4, PAGE_BYTES)
    yield pool
    pool.close()


def test_eviction_takes_least_recently_used_first(pool: BlockPool) -> None:
    tier = CpuTier(pool, TOKEN_BYTES)
    keys = [random_key() for _ in range(4)]
    for key in keys:
        (page,) = pool.allocate(1) or []
        assert tier.insert(key, page, CONTRACT_CHUNK)
    tier.pin_keys([keys[0]])  # use it: keys[0] becomes most recent (and pinned)
    pool.release([tier.entries([keys[0]])[0].page])  # drop the pin, keep the recency
    assert tier.allocate(1) is not None
    assert tier.contains(keys) == [True, False, True, True]


def test_eviction_skips_pinned_pages_and_gives_up_cleanly(pool: BlockPool) -> None:
    tier = CpuTier(pool, TOKEN_BYTES)
    keys = [random_key() for _ in range(4)]
    for key in keys:
        (page,) = pool.allocate(1) or []
        tier.insert(key, page, CONTRACT_CHUNK)
    pinned = tier.pin_keys(keys)
    assert tier.allocate(1) is None  # nothing evictable: no wait, a clean None
    assert tier.contains(keys) == [True] * 4
    pool.release([e.page for e in pinned.values()])
    assert tier.allocate(1) is not None
    assert tier.counters.evicted == 1


def test_insert_of_a_present_key_takes_no_reference(pool: BlockPool) -> None:
    tier = CpuTier(pool, TOKEN_BYTES)
    key = random_key()
    first, second = pool.allocate(2) or []
    assert tier.insert(key, first, CONTRACT_CHUNK)
    assert not tier.insert(key, second, CONTRACT_CHUNK)
    assert pool.refcount(second) == 1  # still only the caller's
    pool.release([second])
    assert pool.free_pages == 3


def test_pin_prefix_pins_up_to_the_first_miss_and_marks_them_recent(pool: BlockPool) -> None:
    tier = CpuTier(pool, TOKEN_BYTES)
    keys = [random_key() for _ in range(4)]
    for key in keys[:3]:
        (page,) = pool.allocate(1) or []
        assert tier.insert(key, page, CONTRACT_CHUNK)
    missing = random_key()
    pages = tier.pin_prefix([keys[1], keys[0], missing, keys[2]])  # keys[2] is after the miss
    assert pages == [e.page for e in tier.entries([keys[1], keys[0]]) if e is not None]
    assert [pool.refcount(p) for p in pages] == [2, 2]
    assert pool.refcount(tier.entries([keys[2]])[0].page) == 1  # type: ignore[union-attr]
    assert tier.pin_prefix([missing, keys[0]]) == []
    pool.release(pages)
    # keys[1] and keys[0] were used last: the next eviction takes keys[2] (then the fourth page
    # is free anyway, so allocating two evicts exactly one).
    assert tier.allocate(2) is not None
    assert tier.contains(keys[:3]) == [True, True, False]


def test_every_eviction_listener_hears_each_eviction_and_a_raising_one_harms_none(
    pool: BlockPool,
) -> None:
    tier = CpuTier(pool, TOKEN_BYTES)
    first: list[bytes] = []
    second: list[bytes] = []

    def broken(keys: object) -> None:
        raise RuntimeError("listener bug")

    tier.add_evict_listener(first.extend)
    tier.add_evict_listener(broken)
    tier.add_evict_listener(second.extend)  # added later: does not replace the first
    keys = [random_key() for _ in range(4)]
    for key in keys:
        (page,) = pool.allocate(1) or []
        tier.insert(key, page, CONTRACT_CHUNK)
    assert tier.allocate(1) is not None  # evicts the oldest
    assert first == second == [keys[0]]
