"""The contract every tier that takes tenants passes (``tenant_quotas``).

A tier's test module subclasses :class:`TenantContract` and provides a ``tenant_tier``
fixture: a factory that builds and opens one tier for :data:`CONTRACT_LAYOUT` and
:data:`CONTRACT_CHUNK`, its ledger made over the quota table it is given (``Tier.tenants``),
closed at teardown; and ``unit_bytes``, what one stored chunk is charged there (a page, a
chunk's file or record). Limits are written in those units, so one suite fits every tier.

Each tier must show, through the put alone (the tenant rides the ``PutJob``):

* the tenant is charged on put (its row counts the chunks it stored, and no one else's);
* a cap holds (a tenant past its limit holds no more than its limit);
* a guarantee holds (a tenant within its limit keeps its chunks while another floods);
* rows are reported, one :class:`~kvtier.storage.tenants.rows.TenantRow` per tenant;
* what the quota took is counted: a tier that evicts counts quota evictions and names them
  in ``evicted_by_quota``; one that refuses instead (``evicts = False``: the PD buffer, whose
  reservations wait for their tenant's share) counts refusals and names nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvtier.config.tenant_quotas import TenantLimit
from kvtier.keys import ChunkKey
from kvtier.storage.base import PutJob, PutOutcome, Tier
from kvtier.storage.tenants import TenantQuotas, TenantRow
from tests.storage.tier_contract import CONTRACT_CHUNK, Outcomes, payload, random_key

# (rows of the quota table) -> an open tier whose ledger reads them
TenantTierFactory = Callable[[TenantQuotas], Tier]


def put_as(tier: Tier, tenant: str, count: int, seed: int = 0) -> list[ChunkKey]:
    """``count`` new chunks of ``tenant`` put one at a time, each landed before the next (a
    remote write is queued); the keys of those the tier stored."""
    stored = []
    for i in range(count):
        key, done = random_key(), Outcomes()
        tier.put(PutJob(key, payload(CONTRACT_CHUNK, seed + i), CONTRACT_CHUNK, tenant, done))
        (result,) = done.wait(1)
        tier.flush(10.0)
        if result.outcome is PutOutcome.STORED:
            stored.append(key)
    return stored


def rows_of(tier: Tier) -> dict[str, TenantRow]:
    assert tier.tenants is not None, "a tier built with quotas has a ledger"
    rows = tier.tenants.rows()
    assert all(isinstance(row, TenantRow) for row in rows)
    return {row.tenant: row for row in rows}


class TenantContract:
    unit_bytes: int  # what one stored chunk is charged in this tier
    evicts = True  # False: a tenant at its limit is refused, nothing of its is evicted

    @pytest.fixture
    def tenant_tier(self) -> TenantTierFactory:  # pragma: no cover - overridden by each
        raise NotImplementedError

    def quotas(self, **units: int) -> TenantQuotas:
        """A table of byte limits, each ``units[t]`` whole chunks of this tier."""
        return TenantQuotas({t: TenantLimit(nbytes=n * self.unit_bytes) for t, n in units.items()})

    def test_the_put_charges_its_tenant(self, tenant_tier: TenantTierFactory) -> None:
        tier = tenant_tier(self.quotas(alice=4, bob=4))
        assert len(put_as(tier, "alice", 2)) == 2
        assert len(put_as(tier, "bob", 1, seed=10)) == 1
        rows = rows_of(tier)
        assert rows["alice"].chunks == 2 and rows["alice"].held_bytes == 2 * self.unit_bytes
        assert rows["bob"].chunks == 1 and rows["bob"].held_bytes == self.unit_bytes

    def test_a_cap_holds(self, tenant_tier: TenantTierFactory) -> None:
        tier = tenant_tier(self.quotas(flood=3))
        put_as(tier, "flood", 8)
        row = rows_of(tier)["flood"]
        assert row.chunks == 3  # at its limit, never past it
        assert row.held_bytes <= (row.limit_bytes or 0) == 3 * self.unit_bytes

    def test_a_guarantee_holds_while_another_tenant_floods(
        self, tenant_tier: TenantTierFactory
    ) -> None:
        tier = tenant_tier(self.quotas(quiet=3, flood=3))
        quiet = put_as(tier, "quiet", 3)
        put_as(tier, "flood", 10, seed=100)
        assert len(quiet) == 3 and tier.contains(quiet) == [True] * 3
        assert rows_of(tier)["quiet"].chunks == 3

    def test_rows_report_each_tenant_with_its_limit(self, tenant_tier: TenantTierFactory) -> None:
        tier = tenant_tier(self.quotas(a=2))
        put_as(tier, "a", 1)
        put_as(tier, "unlimited", 1, seed=5)
        rows = rows_of(tier)
        assert rows["a"].limit_bytes == 2 * self.unit_bytes
        # no row, no "*": no limit (a remote ledger may keep no row for such a tenant at all)
        assert "unlimited" not in rows or rows["unlimited"].limit_bytes is None
        assert rows["a"].as_dict()["held_bytes"] == self.unit_bytes

    def test_what_the_quota_took_is_counted(self, tenant_tier: TenantTierFactory) -> None:
        tier = tenant_tier(self.quotas(flood=2))
        assert tier.tenants is not None
        stored = put_as(tier, "flood", 6)
        row = rows_of(tier)["flood"]
        if not self.evicts:
            assert len(stored) == 2 and row.share_refusals == 4
            assert tier.tenants.evicted_by_quota(stored) == {}
            return
        gone = [key for key, held in zip(stored, tier.contains(stored), strict=True) if not held]
        assert len(gone) == 4 and row.quota_evictions == 4
        assert tier.tenants.evicted_by_quota(stored) == dict.fromkeys(gone, "flood")
