"""The disk index over the eviction-policy seam: the policy chooses victims among unpinned
files, a reservation is all or nothing, and every policy keeps the byte accounting exact."""

from __future__ import annotations

import random

import pytest

from kvtier.storage.disk.index import DiskEntry, DiskIndex
from kvtier.storage.policy import POLICIES, make_policy
from tests.storage.tier_contract import random_key

FILE = 100


def filled(policy: str, count: int, capacity_files: int) -> tuple[DiskIndex, list[bytes]]:
    index = DiskIndex(capacity_files * FILE, make_policy(policy))
    keys = [random_key() for _ in range(count)]
    for key in keys:
        assert index.reserve(FILE) is not None
        index.commit(key, DiskEntry(16, FILE))
    return index, keys


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_reservation_evicts_the_policys_victim_and_never_a_pinned_file(policy: str) -> None:
    index, keys = filled(policy, 3, 3)
    assert index.pin(keys[0])
    expected = next(k for k in index.oldest_first() if k != keys[0])
    assert index.reserve(FILE) == [expected]
    assert keys[0] in index and expected not in index
    assert index.used_bytes + index.reserved_bytes == 3 * FILE


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_reservation_that_cannot_fit_evicts_nothing(policy: str) -> None:
    index, keys = filled(policy, 3, 3)
    for key in keys[:2]:
        assert index.pin(key)
    assert index.reserve(2 * FILE) is None
    assert len(index) == 3 and index.used_bytes == 3 * FILE and index.reserved_bytes == 0
    assert index.reserve(FILE) == [keys[2]]


def test_reuse_on_disk_keeps_a_used_file_over_a_new_one() -> None:
    index, keys = filled("REUSE", 2, 2)
    index.touch([keys[0]])  # used once (a read, or a hit in the CPU tier above)
    index.touch([random_key()])  # not indexed: ignored
    assert index.reserve(FILE) == [keys[1]]


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_random_operations_keep_bytes_and_order_exact(policy: str) -> None:
    rng = random.Random(3)
    index = DiskIndex(8 * FILE, make_policy(policy))
    model: dict[bytes, int] = {}
    pins: dict[bytes, int] = {}
    for _ in range(1500):
        op = rng.randrange(5)
        if op == 0:
            size = rng.choice((FILE, 2 * FILE))
            victims = index.reserve(size)
            if victims is None:
                continue
            for v in victims:
                assert v not in pins
                del model[v]
            key = random_key()
            index.commit(key, DiskEntry(16, size))
            model[key] = size
        elif op == 1 and model:
            key = rng.choice(sorted(model))
            assert index.pin(key)
            pins[key] = pins.get(key, 0) + 1
        elif op == 2 and pins:
            key = rng.choice(sorted(pins))
            assert index.unpin(key)
            pins[key] -= 1
            if not pins[key]:
                del pins[key]
        elif op == 3 and model:
            index.touch(rng.sample(sorted(model), min(3, len(model))))
        elif op == 4 and model:
            key = rng.choice(sorted(model))
            if key not in pins:
                assert index.pop(key) is not None
                del model[key]
        assert index.used_bytes == sum(model.values()) <= index.capacity_bytes
        assert set(index.oldest_first()) == set(model) == {k for k, _ in index.items()}


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_evictable_bytes_follow_pins_and_evict_one_skips_them(policy: str) -> None:
    """What the directory's budget relies on (kvtier.storage.disk.budget)."""
    index, keys = filled(policy, 3, 3)
    assert index.pin(keys[0]) and index.pin(keys[0])  # two pins: one file's bytes
    assert index.pin(keys[1])
    assert index.evictable_bytes == FILE
    assert index.evict_one() == (keys[2], FILE)
    assert index.evictable_bytes == 0 and index.used_bytes == 2 * FILE
    assert index.unpin(keys[0]) and index.evictable_bytes == 0  # one pin left
    assert index.unpin(keys[0]) and index.evictable_bytes == FILE
    index.pop(keys[1])  # pinned, removed: its pin goes with it
    assert index.pinned_bytes == 0 and index.evictable_bytes == FILE
    index.drop_all()
    assert index.pinned_bytes == index.used_bytes == index.evictable_bytes == 0
