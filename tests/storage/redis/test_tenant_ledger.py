"""Hypothesis drives two Redis tiers (two engines of a fleet) on one real Redis, and on a
real 3-master cluster, with the ledger's script and with its MULTI/EXEC fallback, through
stores of three tenants, stores of a chunk again, chunks Redis drops on its own (maxmemory,
expiry: deleted behind the tiers' backs) and quota changes set
on both engines. After every step, for every tenant:

* every chunk it holds is in its ledger (none goes uncounted), and every ledger member is a
  chunk it holds or one Redis dropped (stale: the ledger errs low only);
* with a limit, it holds at most that many chunks, and its newest chunk survived its store;
* the tenant that never has a limit loses no chunk but those Redis dropped.
"""

from __future__ import annotations

import itertools
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

from kvtier.config.tenant_quotas import TenantLimit
from kvtier.keys import ChunkKey
from kvtier.storage.base import PutOutcome
from kvtier.storage.redis.tenant_ledger import ledger_name
from kvtier.storage.redis.tier import RedisTier
from tests.storage.redis.test_quotas import UNIT, open_tiers
from tests.storage.remote.helpers import put_as
from tests.storage.tier_contract import CONTRACT_CHUNK, payload

LIMITED = ("a", "b")  # tenants whose limit the machine changes
FREE = "free"  # never a limit
SEEDS = itertools.count(1)  # chunk keys never repeat across examples


class Fleet(RuleBasedStateMachine):
    tiers: ClassVar[list[RedisTier]] = []  # set by the test: two tiers, the same Redis

    def __init__(self) -> None:
        super().__init__()
        for tier in self.tiers:  # every example: an empty store, limited tenants at 2
            for tenant in LIMITED:
                assert tier.ledger is not None
                tier.ledger.quotas.set(tenant, TenantLimit(nbytes=2 * UNIT))
        self.tiers[0].store.link.call(lambda client: _flush(client))
        self.stored: dict[str, list[ChunkKey]] = {t: [] for t in (*LIMITED, FREE)}
        self.dropped: set[ChunkKey] = set()  # deleted behind the tiers' backs
        self.limits: dict[str, int | None] = dict.fromkeys(LIMITED, 2)

    def _store(self, engine: int, tenant: str, key: ChunkKey) -> None:
        tier = self.tiers[engine]
        result = put_as(tier, tenant, key, payload(CONTRACT_CHUNK, key[-1]), CONTRACT_CHUNK)
        limit = self.limits.get(tenant)
        if limit == 0:
            assert result.outcome is PutOutcome.DROPPED  # under one chunk: refused
            return
        assert result.outcome is PutOutcome.STORED, result
        self.dropped.discard(key)
        if key in self.stored[tenant]:
            self.stored[tenant].remove(key)
        self.stored[tenant].append(key)  # the newest
        assert tier.contains([key]) == [True]  # its newest chunk survived its own store

    @rule(engine=st.integers(0, 1), tenant=st.sampled_from((*LIMITED, FREE)))
    def store_new(self, engine: int, tenant: str) -> None:
        self._store(engine, tenant, next(SEEDS).to_bytes(16, "big"))

    @precondition(lambda self: any(self.stored.values()))
    @rule(engine=st.integers(0, 1), data=st.data())
    def store_again(self, engine: int, data: st.DataObject) -> None:
        tenant = data.draw(st.sampled_from([t for t, keys in self.stored.items() if keys]))
        self._store(engine, tenant, data.draw(st.sampled_from(self.stored[tenant])))

    @precondition(lambda self: any(self.stored.values()))
    @rule(data=st.data())
    def redis_drops_one(self, data: st.DataObject) -> None:
        keys = [k for keys in self.stored.values() for k in keys]
        key = data.draw(st.sampled_from(keys))
        name = self.tiers[0].store.name_of(key)
        self.tiers[0].store.link.call(lambda client: client.delete(name))
        self.dropped.add(key)

    @rule(tenant=st.sampled_from(LIMITED), chunks=st.none() | st.integers(0, 4))
    def set_limit(self, tenant: str, chunks: int | None) -> None:
        limit = None if chunks is None else TenantLimit(nbytes=chunks * UNIT)
        for tier in self.tiers:  # a row rolled out to the fleet
            assert tier.ledger is not None
            tier.ledger.quotas.set(tenant, limit)
        self.limits[tenant] = chunks

    @invariant()
    def each_tenant_is_counted_and_within_its_limit(self) -> None:
        tier = self.tiers[0]
        for tenant, keys in self.stored.items():
            held = {k for k, h in zip(keys, tier.contains(keys), strict=True) if h}
            ledger = ledger_name(tier.fingerprint.hex(), tenant)
            counted = {bytes.fromhex(m.split(b":")[1].decode()) for m in _members(tier, ledger)}
            assert held <= counted, "a chunk its ledger does not count"
            assert counted <= held | self.dropped, "a ledger member never stored"
            limit = self.limits.get(tenant)
            if limit is not None:
                assert len(held) <= max(limit, 0)
            if tenant == FREE:
                assert held == set(keys) - self.dropped


def _members(tier: RedisTier, ledger: bytes) -> list[bytes]:
    return list(tier.store.link.call(lambda client: client.zrange(ledger, 0, -1)))


def _flush(client: object) -> None:
    from redis.cluster import RedisCluster

    if isinstance(client, RedisCluster):
        client.flushall(target_nodes=RedisCluster.PRIMARIES)
    else:
        client.flushall()  # type: ignore[attr-defined]


@pytest.mark.parametrize("scripts", [True, False], ids=["script", "multi-exec"])
@pytest.mark.parametrize("where", ["server", "cluster"])
def test_two_engines_keep_every_tenant_counted_and_capped(
    where: str, scripts: bool, request: pytest.FixtureRequest
) -> None:
    url = request.getfixturevalue(where).url
    tiers = open_tiers(url, {}, count=2)
    for tier in tiers:  # multi-exec: as where the server refuses EVAL
        assert tier.ledger is not None
        tier.ledger._use_script = scripts
    Fleet.tiers = tiers
    try:
        run_state_machine_as_test(
            Fleet, settings=settings(max_examples=30, stateful_step_count=30, deadline=None)
        )
    finally:
        Fleet.tiers = []
        for tier in tiers:
            tier.close()
