"""Hypothesis drives two s3 tiers (two engines of a fleet) on one real S3 bucket
(SeaweedFS) through stores of three tenants, listings by either engine, objects deleted
behind the tiers' backs (a lifecycle rule) and limits changed on both. After every step:

* every chunk in the bucket has its tenant's marker (none goes uncounted);
* a limited tenant holds at most twice its limit (each engine's own writes at most once
  its limit), and exactly within it right after both engines listed and one stored;
* the tenant that never has a limit loses no chunk but those deleted behind the backs.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import ClassVar

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvtier.bench.seaweedfs import SeaweedFS
from kvtier.config.tenant_quotas import TenantLimit
from kvtier.keys import ChunkKey
from kvtier.storage.base import PutOutcome
from kvtier.storage.s3.client import S3Client
from kvtier.storage.s3.quotas import S3Ledger, tenant_dir
from kvtier.storage.s3.tier import S3Tier
from kvtier.storage.tenants.quotas import TenantQuotas
from tests.storage.remote.helpers import put_as
from tests.storage.s3.test_quotas import UNIT
from tests.storage.s3.test_tier import FINGERPRINT, options, raw_client
from tests.storage.tier_contract import CONTRACT_CHUNK, payload

LIMITED = ("a", "b")
FREE = "free"
SEEDS = itertools.count(1)


class Fleet(RuleBasedStateMachine):
    tiers: ClassVar[list[S3Tier]] = []
    raw: ClassVar[S3Client | None] = None

    def __init__(self) -> None:
        super().__init__()
        for tier in self.tiers:  # each limited tenant starts at 2 chunks
            for tenant in LIMITED:
                self._quotas(tier).quotas.set(tenant, TenantLimit(nbytes=2 * UNIT))
            tier.clear()
        assert self.raw is not None
        self.raw.delete([name for name, _ in self.raw.list("")])  # markers too
        for tier in self.tiers:
            assert tier.store.refresh()
        self.stored: dict[str, list[ChunkKey]] = {t: [] for t in (*LIMITED, FREE)}
        self.gone: set[ChunkKey] = set()
        self.limits: dict[str, int | None] = dict.fromkeys(LIMITED, 2)

    @staticmethod
    def _quotas(tier: S3Tier) -> S3Ledger:
        assert tier.ledger is not None
        return tier.ledger

    def _bucket(self) -> set[ChunkKey]:
        assert self.raw is not None
        prefix = self.tiers[0].store.prefix
        return {bytes.fromhex(n[len(prefix) :]) for n, _ in self.raw.list(prefix)}

    def _markers(self) -> dict[str, set[ChunkKey]]:
        assert self.raw is not None
        root = self._quotas(self.tiers[0]).marker_prefix
        found: dict[str, set[ChunkKey]] = {}
        for name, _ in self.raw.list(root):
            directory, _, member = name[len(root) :].partition("/")
            found.setdefault(directory, set()).add(bytes.fromhex(member.split(".")[1]))
        return found

    @rule(engine=st.integers(0, 1), tenant=st.sampled_from((*LIMITED, FREE)))
    def store(self, engine: int, tenant: str) -> None:
        key = next(SEEDS).to_bytes(16, "big")
        tier = self.tiers[engine]
        result = put_as(tier, tenant, key, payload(CONTRACT_CHUNK, key[-1]), CONTRACT_CHUNK)
        if self.limits.get(tenant) == 0:
            assert result.outcome is PutOutcome.DROPPED
            return
        assert result.outcome is PutOutcome.STORED, result
        self.stored[tenant].append(key)
        assert tier.contains([key]) == [True]  # its newest survived its own store

    @rule(engine=st.integers(0, 1))
    def listing(self, engine: int) -> None:
        assert self.tiers[engine].store.refresh()

    @rule(tenant=st.sampled_from(LIMITED))
    def both_list_then_one_stores(self, tenant: str) -> None:
        for tier in self.tiers:
            assert tier.store.refresh()
        self.store(0, tenant)
        limit = self.limits[tenant]
        if limit:
            held = self._bucket() & set(self.stored[tenant])
            assert len(held) <= limit, "over its limit right after a listing and a store"

    @precondition(lambda self: any(self.stored.values()))
    @rule(data=st.data())
    def lifecycle_rule_deletes_one(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from([k for keys in self.stored.values() for k in keys]))
        assert self.raw is not None
        self.raw.delete([self.tiers[0].store.name_of(key)])
        self.gone.add(key)

    @rule(tenant=st.sampled_from(LIMITED), chunks=st.none() | st.integers(0, 3))
    def set_limit(self, tenant: str, chunks: int | None) -> None:
        limit = None if chunks is None else TenantLimit(nbytes=chunks * UNIT)
        for tier in self.tiers:
            self._quotas(tier).quotas.set(tenant, limit)
        self.limits[tenant] = chunks

    @invariant()
    def counted_and_capped(self) -> None:
        bucket = self._bucket()
        markers = self._markers()
        for tenant, keys in self.stored.items():
            held = bucket & set(keys)
            assert held <= markers.get(tenant_dir(tenant), set()), "a chunk with no marker"
            limit = self.limits.get(tenant)
            if limit is not None:
                assert len(held) <= 2 * limit
            if tenant == FREE:
                assert held == set(keys) - self.gone


@pytest.fixture
def fleet(seaweedfs: SeaweedFS, bucket: str) -> Iterator[list[S3Tier]]:
    tiers = []
    for _ in range(2):
        tier = S3Tier(options(seaweedfs, bucket), FINGERPRINT.layout, FINGERPRINT)
        tier.attach_quotas(TenantQuotas({}))
        tier.open()
        tiers.append(tier)
    Fleet.raw = raw_client(seaweedfs, bucket)
    yield tiers
    Fleet.raw = None
    for tier in tiers:
        tier.close()


def test_two_engines_keep_every_chunk_counted_and_each_tenant_capped(
    fleet: list[S3Tier],
) -> None:
    Fleet.tiers = fleet
    try:
        run_state_machine_as_test(
            Fleet, settings=settings(max_examples=20, stateful_step_count=25, deadline=None)
        )
    finally:
        Fleet.tiers = []
