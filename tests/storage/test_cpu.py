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
