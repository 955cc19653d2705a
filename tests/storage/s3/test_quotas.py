"""tenant_quotas in the s3 tier, against a real S3 server (SeaweedFS): a tenant's oldest
objects deleted when it is over its limit, another tenant's untouched; several engines (tier
instances on one bucket) hold it to its limit together as of each one's last listing, and a
restarted engine counts what was stored before it (the marker objects outlive it)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import pytest

from kvtier import Engine
from kvtier.bench.seaweedfs import SeaweedFS
from kvtier.config.tenant_quotas import TenantLimit, parse_limit
from kvtier.fingerprint import Fingerprint
from kvtier.keys import ChunkKey
from kvtier.observability.metrics import engine_registry
from kvtier.storage import records
from kvtier.storage.base import Membership, PutOutcome
from kvtier.storage.s3.quotas import tenant_dir
from kvtier.storage.s3.tier import S3Tier
from kvtier.storage.tenants.quotas import TenantQuotas
from tests.conftest import SMALL_CHUNK, SMALL_LAYOUT, make_kv, make_tokens, small_config
from tests.storage.remote.helpers import put_as, tenant_rows
from tests.storage.s3.test_tier import FINGERPRINT, options, raw_client
from tests.storage.tenant_contract import TenantContract, TenantTierFactory
from tests.storage.tier_contract import CONTRACT_CHUNK, payload

UNIT = records.header_size() + FINGERPRINT.layout.payload_bytes(CONTRACT_CHUNK)

OpenTier = Callable[..., S3Tier]


@pytest.fixture
def open_tier(seaweedfs: SeaweedFS, bucket: str) -> Iterator[OpenTier]:
    """Tiers on one bucket and prefix, each with its own quota table (an engine each)."""
    opened: list[S3Tier] = []

    def open_one(rows: dict[str, str], fingerprint: Fingerprint = FINGERPRINT) -> S3Tier:
        tier = S3Tier(options(seaweedfs, bucket), fingerprint.layout, fingerprint)
        table = {t: parse_limit("tenant_quotas", v) for t, v in rows.items()}
        tier.attach_quotas(TenantQuotas(table))
        tier.open()
        opened.append(tier)
        return tier

    yield open_one
    for tier in opened:
        tier.close()


def store(tier: S3Tier, tenant: str, seed: int) -> ChunkKey:
    key = seed.to_bytes(16, "big")
    result = put_as(tier, tenant, key, payload(CONTRACT_CHUNK, seed), CONTRACT_CHUNK)
    assert result.outcome is PutOutcome.STORED, result
    return key


def in_bucket(tier: S3Tier, seaweedfs: SeaweedFS, bucket: str) -> set[ChunkKey]:
    raw = raw_client(seaweedfs, bucket)
    return {bytes.fromhex(name.rsplit("/", 1)[1]) for name, _ in raw.list(tier.store.prefix)}


def test_a_flood_stays_within_its_quota_and_another_tenant_keeps_its_objects(
    open_tier: OpenTier, seaweedfs: SeaweedFS, bucket: str
) -> None:
    tier = open_tier({"flood": f"{3 * UNIT}B"})
    evicted: list[ChunkKey] = []
    tier.add_evict_listener(evicted.extend)
    removed: list[ChunkKey] = []
    tier.add_membership_listener(
        lambda change, keys: removed.extend(keys) if change is Membership.REMOVED else None
    )
    calm = [store(tier, "calm", seed) for seed in range(1, 3)]
    flood = [store(tier, "flood", seed) for seed in range(100, 110)]
    assert in_bucket(tier, seaweedfs, bucket) == set(calm) | set(flood[-3:])
    assert tier.contains(flood) == [False] * 7 + [True] * 3  # the index knows too
    assert evicted == removed == flood[:7]  # KV events and explain hear of each
    assert tier.tenants.evicted_by_quota(flood) == dict.fromkeys(flood[:7], "flood")
    report = tenant_rows(tier)
    assert report["flood"]["held_bytes"] == 3 * UNIT
    assert report["flood"]["limit_bytes"] == 3 * UNIT
    assert report["flood"]["quota_evictions"] == 7
    assert report["calm"]["chunks"] == 2 and report["calm"]["limit_bytes"] is None


def test_the_cap_holds_across_engines_as_of_each_ones_last_listing(
    open_tier: OpenTier, seaweedfs: SeaweedFS, bucket: str
) -> None:
    a, b = open_tier({"t": f"{2 * UNIT}B"}), open_tier({"t": f"{2 * UNIT}B"})
    from_a = [store(a, "t", seed) for seed in range(1, 5)]
    from_b = [store(b, "t", seed) for seed in range(11, 15)]
    # Neither had listed the other's writes: each kept its own newest 2 (the bound the
    # docs give: the limit plus what the others stored within one listing interval).
    assert in_bucket(a, seaweedfs, bucket) == set(from_a[-2:]) | set(from_b[-2:])
    markers = raw_client(seaweedfs, bucket).list(b.ledger.marker_prefix)  # type: ignore[union-attr]
    assert {name.rsplit("/", 2)[1] for name, _ in markers} == {"t" + b"t".hex()}
    assert b.store.refresh()  # b's listing now has a's markers: the fleet's order
    from_b.append(store(b, "t", 15))
    assert in_bucket(a, seaweedfs, bucket) == {from_b[-2], from_b[-1]}  # a's went too
    assert tenant_rows(b)["t"]["chunks"] == 2


def test_the_tp_ranks_of_a_model_share_a_tenants_limit(
    open_tier: OpenTier, seaweedfs: SeaweedFS, bucket: str
) -> None:
    ranks = [dataclasses.replace(FINGERPRINT, tp_rank=r, tp_world_size=2) for r in (0, 1)]
    r0, r1 = (open_tier({"t": f"{4 * UNIT}B"}, fingerprint) for fingerprint in ranks)
    keys0 = [store(r0, "t", seed) for seed in range(1, 4)]
    assert r1.store.refresh()  # rank 1 has listed rank 0's markers: one order for both
    keys1 = [store(r1, "t", seed) for seed in range(1, 4)]
    assert in_bucket(r0, seaweedfs, bucket) == {keys0[2]}  # rank 0's two oldest went
    assert in_bucket(r1, seaweedfs, bucket) == set(keys1)  # 4 in all: the limit
    report = tenant_rows(r1)["t"]
    assert report["chunks"] == 4 and report["quota_evictions"] == 2
    assert r1.tenants.evicted_by_quota(keys1) == {}  # rank 0's keys: not reported as rank 1's


def test_salts_under_the_star_row_share_one_order_fleet_wide(
    open_tier: OpenTier, seaweedfs: SeaweedFS, bucket: str
) -> None:
    """A client that sends a new cache_salt with each request gets the "*" row once: the
    sprayed salts together keep the row's 3 objects, and a named tenant keeps its own."""
    tier = open_tier({"alice": f"{4 * UNIT}B", "*": f"{3 * UNIT}B"})
    alice = [store(tier, "alice", seed) for seed in range(1, 5)]
    sprayed = [store(tier, f"salt{seed}", seed) for seed in range(10, 20)]
    assert in_bucket(tier, seaweedfs, bucket) == set(alice) | set(sprayed[-3:])
    report = tenant_rows(tier)
    assert report["*"]["chunks"] == 3 and report["alice"]["chunks"] == 4
    later = open_tier({"alice": f"{4 * UNIT}B", "*": f"{3 * UNIT}B"})  # lists the markers
    assert tenant_rows(later)["*"]["chunks"] == 3


def test_an_engine_started_later_counts_what_the_fleet_stored_before(
    open_tier: OpenTier, seaweedfs: SeaweedFS, bucket: str
) -> None:
    first = open_tier({"t": f"{3 * UNIT}B"})
    before = [store(first, "t", seed) for seed in range(1, 4)]
    first.close()
    later = open_tier({"t": f"{3 * UNIT}B"})  # a restart: it lists the markers at open
    assert tenant_rows(later)["t"]["chunks"] == 3
    after = store(later, "t", 4)
    assert in_bucket(later, seaweedfs, bucket) == {before[1], before[2], after}


def test_a_lowered_limit_applies_at_once_and_gone_objects_cost_no_live_one(
    open_tier: OpenTier, seaweedfs: SeaweedFS, bucket: str
) -> None:
    tier = open_tier({"t": f"{4 * UNIT}B"})
    keys = [store(tier, "t", seed) for seed in range(1, 5)]
    raw_client(seaweedfs, bucket).delete([tier.store.name_of(keys[0])])  # a lifecycle rule
    assert tier.store.refresh()  # its marker stays: a stale member, the oldest
    keys.append(store(tier, "t", 5))
    assert in_bucket(tier, seaweedfs, bucket) == set(keys[1:])  # 4: nothing live went
    assert tenant_rows(tier)["t"]["stale_entries"] == 1
    assert tier.ledger is not None
    tier.ledger.quotas.set("t", TenantLimit(nbytes=UNIT))  # PUT /quota
    assert in_bucket(tier, seaweedfs, bucket) == {keys[-1]}


def test_a_share_or_a_limit_under_one_chunk_is_refused_clearly(
    open_tier: OpenTier, caplog: pytest.LogCaptureFixture
) -> None:
    tier = open_tier({"tiny": "1KiB", "*": "10%"})
    assert "rows ['*'] are shares" in caplog.text  # an object store has no capacity
    key = (1).to_bytes(16, "big")
    result = put_as(tier, "tiny", key, payload(CONTRACT_CHUNK, 1), CONTRACT_CHUNK)
    assert result.outcome is PutOutcome.DROPPED
    assert "tenant 'tiny'" in result.detail and f"below one chunk ({UNIT} bytes)" in result.detail
    assert tier.contains([key]) == [False]
    assert store(tier, "anyone", 2)  # the share row binds nothing here
    assert tenant_rows(tier)["anyone"]["limit_bytes"] is None


def test_an_engines_s3_tier_reports_its_tenants_in_stats_and_metrics(
    seaweedfs: SeaweedFS, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, setting in seaweedfs.environment().items():  # AWS_* as in production
        monkeypatch.setenv(name, setting)
    unit = records.header_size() + SMALL_LAYOUT.payload_bytes(SMALL_CHUNK)
    prompt = 4 * SMALL_CHUNK
    config = small_config(
        cpu_chunks=64,
        remote_url=f"s3://{bucket}/fleet",
        tenant_quotas={"flood": f"{2 * unit}B"},
        extra_config={"s3_list_interval_secs": 0},
    )
    with Engine(config, SMALL_LAYOUT, model_name="m") as engine:
        for seed in range(1, 4):  # 12 chunks of "flood": 2 stay in the bucket
            engine.store(make_tokens(prompt, seed), make_kv(prompt, seed), cache_salt="flood")
        engine.store(make_tokens(prompt, 9), make_kv(prompt, 9), cache_salt="calm")
        assert engine.flush(20.0)
        tenants = engine.stats()["tiers"]["s3"]["tenants"]
        assert tenants["flood"]["held_bytes"] == 2 * unit
        assert tenants["flood"]["quota_evictions"] == 10
        assert tenants["calm"]["chunks"] == 4
        value = engine_registry(engine).get_sample_value
        labels = {"tier": "s3", "tenant": "flood"}
        assert value("kvtier_tenant_held_bytes", labels) == 2 * unit
        assert value("kvtier_tenant_quota_evictions_total", labels) == 10


def test_a_tenant_too_long_for_a_key_is_named_by_its_digest_and_still_capped(
    open_tier: OpenTier, seaweedfs: SeaweedFS, bucket: str
) -> None:
    long = "x" * 300  # 600 hex characters: past MAX_DIR_HEX
    assert tenant_dir(long).startswith("h") and len(tenant_dir(long)) == 33
    first = open_tier({long: f"{2 * UNIT}B"})
    before = [store(first, long, seed) for seed in range(1, 4)]
    later = open_tier({long: f"{2 * UNIT}B"})  # lists the digest's markers: its row's
    assert tenant_rows(later)[long]["chunks"] == 2
    after = store(later, long, 4)
    assert in_bucket(later, seaweedfs, bucket) == {before[2], after}


class TestS3TenantContract(TenantContract):
    """A cap kept with marker objects the fleet lists (no guarantee of its own: another
    tenant's flood deletes only its own objects, so the quiet tenant's stay)."""

    unit_bytes = UNIT

    @pytest.fixture
    def tenant_tier(self, seaweedfs: SeaweedFS, bucket: str) -> Iterator[TenantTierFactory]:
        made: list[S3Tier] = []

        def make(quotas: TenantQuotas) -> S3Tier:
            tier = S3Tier(options(seaweedfs, bucket), FINGERPRINT.layout, FINGERPRINT)
            tier.attach_quotas(quotas)
            tier.open()
            made.append(tier)
            return tier

        yield make
        for tier in made:
            tier.close()
