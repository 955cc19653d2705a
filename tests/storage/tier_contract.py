"""The contract every storage tier passes.

A tier's test module subclasses :class:`TierContract` and provides a ``tier`` fixture that
yields an open tier for :data:`CONTRACT_LAYOUT` and :data:`CONTRACT_CHUNK`, closing it at
teardown. Every test here runs against every tier (CPU, disk, redis, redis cluster, ...).
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

from kvtier.keys import ChunkKey
from kvtier.layout import KVLayout
from kvtier.storage.base import Membership, PutJob, PutOutcome, PutResult, Tier
from tests.hosts import not_applicable

CONTRACT_LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)
CONTRACT_CHUNK = 16
TOKEN_BYTES = CONTRACT_LAYOUT.token_bytes()
PAGE_BYTES = CONTRACT_LAYOUT.chunk_bytes(CONTRACT_CHUNK)


def random_key() -> ChunkKey:
    return os.urandom(16)


def payload(num_tokens: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (num_tokens * TOKEN_BYTES,), dtype=torch.uint8, generator=gen)


class Outcomes:
    """Collects put completions; each put must complete exactly once."""

    def __init__(self) -> None:
        self.results: list[PutResult] = []
        self._cond = threading.Condition()

    def __call__(self, result: PutResult) -> None:
        with self._cond:
            self.results.append(result)
            self._cond.notify_all()

    def wait(self, count: int, timeout: float = 10.0) -> list[PutResult]:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.results) >= count, timeout), (
                f"only {len(self.results)} of {count} puts completed"
            )
        return self.results


def put_and_wait(tier: Tier, key: ChunkKey, data: torch.Tensor, num_tokens: int) -> PutResult:
    done = Outcomes()
    tier.put(PutJob(key, data, num_tokens, "", done))
    result = done.wait(1)[0]
    tier.flush(10.0)
    return result


class TierContract:
    # What a tier storing through a lossy codec overrides (tests/storage/test_cpu_codec.py):
    # KV-like payloads (random bytes are no floats: NaNs among them), compared within the
    # codec's error, and the least stored bytes per payload byte ``usage`` may count.
    stored_fraction = 1.0

    @pytest.fixture
    def tier(self) -> Tier:  # pragma: no cover - overridden by every subclass
        raise NotImplementedError

    def payload(self, num_tokens: int, seed: int) -> torch.Tensor:
        return payload(num_tokens, seed)

    def assert_same(self, out: torch.Tensor, data: torch.Tensor, num_tokens: int) -> None:
        assert torch.equal(out[: data.numel()], data)

    def test_put_then_get_returns_the_same_bytes(self, tier: Tier) -> None:
        key, data = random_key(), self.payload(CONTRACT_CHUNK, 1)
        assert put_and_wait(tier, key, data, CONTRACT_CHUNK).outcome is PutOutcome.STORED
        assert tier.contains([key]) == [True]
        out = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
        assert tier.get_into(key, out) == CONTRACT_CHUNK
        self.assert_same(out, data, CONTRACT_CHUNK)

    def test_partial_chunk_round_trips_with_its_token_count(self, tier: Tier) -> None:
        key, data = random_key(), self.payload(5, 2)
        put_and_wait(tier, key, data, 5)
        out = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
        assert tier.get_into(key, out) == 5
        self.assert_same(out, data, 5)

    def test_unknown_key_is_a_miss(self, tier: Tier) -> None:
        key = random_key()
        assert tier.contains([key]) == [False]
        assert tier.get_into(key, torch.zeros(PAGE_BYTES, dtype=torch.uint8)) is None

    def test_contains_answers_a_batch_in_order(self, tier: Tier) -> None:
        keys = [random_key() for _ in range(5)]
        for i in (0, 2, 3):
            put_and_wait(tier, keys[i], self.payload(CONTRACT_CHUNK, i), CONTRACT_CHUNK)
        assert tier.contains(keys) == [True, False, True, True, False]

    def test_second_put_of_a_key_keeps_the_first_bytes(self, tier: Tier) -> None:
        key = random_key()
        first, second = self.payload(CONTRACT_CHUNK, 3), self.payload(CONTRACT_CHUNK, 4)
        put_and_wait(tier, key, first, CONTRACT_CHUNK)
        result = put_and_wait(tier, key, second, CONTRACT_CHUNK)
        assert result.outcome in (PutOutcome.EXISTS, PutOutcome.STORED)
        out = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
        tier.get_into(key, out)
        expected = first if result.outcome is PutOutcome.EXISTS else second
        self.assert_same(out, expected, CONTRACT_CHUNK)

    def test_every_put_completes_exactly_once(self, tier: Tier) -> None:
        done = Outcomes()
        keys = [random_key() for _ in range(6)]
        for i, key in enumerate(keys):
            tier.put(PutJob(key, self.payload(CONTRACT_CHUNK, 10 + i), CONTRACT_CHUNK, "", done))
        results = done.wait(len(keys))
        tier.flush(10.0)
        assert sorted(r.key for r in results) == sorted(keys)
        assert len(done.results) == len(keys)

    def test_remove_makes_a_miss(self, tier: Tier) -> None:
        key = random_key()
        put_and_wait(tier, key, self.payload(CONTRACT_CHUNK, 5), CONTRACT_CHUNK)
        assert tier.remove(key) is True
        assert tier.contains([key]) == [False]
        assert tier.remove(key) is False

    def test_a_published_tier_reports_each_chunk_it_adds_and_loses(self, tier: Tier) -> None:
        """What KV events publish (``Tier.add_membership_listener``): an add once the chunk is
        readable (before its put completes), a removal for ``remove`` and for ``clear``."""
        if tier.medium is None:  # PD buffer, peers: not this node's cache to publish
            not_applicable("this tier is not published in KV events")
        changes: list[tuple[Membership, list[ChunkKey]]] = []
        tier.add_membership_listener(lambda change, keys: changes.append((change, list(keys))))
        a, b = random_key(), random_key()
        for i, key in enumerate((a, b)):
            result = put_and_wait(tier, key, self.payload(CONTRACT_CHUNK, 40 + i), CONTRACT_CHUNK)
            assert result.outcome is PutOutcome.STORED
        assert changes == [(Membership.ADDED, [a]), (Membership.ADDED, [b])]
        assert tier.remove(a) is True
        assert changes[2:] == [(Membership.REMOVED, [a])]
        tier.clear()  # a shared store may clear other tests' chunks of this fingerprint too
        ((change, cleared),) = changes[3:]
        assert change is Membership.REMOVED and b in cleared and a not in cleared

    def test_usage_counts_entries(self, tier: Tier) -> None:
        before = tier.usage().entries
        for i in range(3):
            put_and_wait(tier, random_key(), self.payload(CONTRACT_CHUNK, 20 + i), CONTRACT_CHUNK)
        usage = tier.usage()
        assert usage.entries == before + 3
        assert usage.used_bytes >= 3 * CONTRACT_CHUNK * TOKEN_BYTES * self.stored_fraction
        assert usage.capacity_bytes >= usage.used_bytes

    def test_clear_removes_unpinned_entries(self, tier: Tier) -> None:
        keys = [random_key() for _ in range(3)]
        for i, key in enumerate(keys):
            put_and_wait(tier, key, self.payload(CONTRACT_CHUNK, 30 + i), CONTRACT_CHUNK)
        pinned = tier.pin(keys[0])
        tier.clear()
        expected = [pinned, False, False]
        assert tier.contains(keys) == expected
        if pinned:
            tier.unpin(keys[0])

    def test_pin_many_pins_a_run_and_stops_where_pin_would(self, tier: Tier) -> None:
        keys = [random_key() for _ in range(3)]
        for i, key in enumerate(keys):
            put_and_wait(tier, key, self.payload(CONTRACT_CHUNK, 45 + i), CONTRACT_CHUNK)
        missing = random_key()
        refuses = not tier.pin(missing)  # a shared store pins without a guarantee
        if not refuses:
            tier.unpin(missing)
        run = [keys[0], keys[1], missing, keys[2]]
        pinned = tier.pin_many(run)
        assert pinned == (2 if refuses else 4)
        if refuses:  # a real pin: clear() spares the run
            tier.clear()
            assert tier.contains(keys) == [True, True, False]
        tier.unpin_many(run[:pinned])
        tier.clear()
        assert tier.contains(keys) == [False] * 3

    def test_pin_keeps_an_entry_until_unpinned(self, tier: Tier) -> None:
        key = random_key()
        put_and_wait(tier, key, self.payload(CONTRACT_CHUNK, 40), CONTRACT_CHUNK)
        # Every tier claims pinning (kvtier.storage.base: pin() of a present entry returns
        # True, with or without a guarantee against other clients): a False here is a broken
        # pin, not a tier that opts out, so it fails rather than skipping what is tested.
        assert tier.pin(key), f"{tier.name}: pin() of a stored entry returned False"
        tier.clear()  # removes every unpinned entry: never this one
        assert tier.contains([key]) == [True], f"{tier.name}: clear() removed a pinned entry"
        tier.unpin(key)
        tier.clear()
        assert tier.contains([key]) == [False]
