"""tenant_quotas in the Redis tier, against a real redis-server and a real 3-master cluster:
two tier instances on one Redis are two engines of a fleet (and two ``kvtier server``
processes, two hosts); a tenant's ledger bounds it across all of them, and only its own
chunks go."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import pytest
import torch

from kvtier import Engine, Service
from kvtier.config.remote_url import parse_remote_url
from kvtier.config.tenant_quotas import TenantLimit, parse_limit
from kvtier.errors import ConfigError
from kvtier.fingerprint import Fingerprint
from kvtier.keys import ChunkKey
from kvtier.observability.metrics import engine_registry
from kvtier.storage import records
from kvtier.storage.base import PutOutcome
from kvtier.storage.redis.options import RedisOptions
from kvtier.storage.redis.tenant_ledger import ledger_name
from kvtier.storage.redis.tier import RedisTier
from kvtier.storage.tenants.quotas import TenantQuotas
from tests.admin.client import call
from tests.admin.test_quota_endpoints import TOKEN, open_service
from tests.conftest import SMALL_CHUNK, SMALL_LAYOUT, make_kv, make_tokens, small_config
from tests.redis_servers import RedisClusterServers, RedisServer
from tests.server.server_helpers import ServerProcess, open_client, remove_tempdir, short_tempdir
from tests.storage.redis.test_redis import FINGERPRINT
from tests.storage.remote.helpers import put_as, tenant_rows
from tests.storage.tenant_contract import TenantContract, TenantTierFactory
from tests.storage.tier_contract import CONTRACT_CHUNK, payload

UNIT = records.header_size() + FINGERPRINT.layout.payload_bytes(CONTRACT_CHUNK)


@pytest.fixture(params=["server", "cluster"])
def url(request: pytest.FixtureRequest) -> Iterator[str]:
    """One redis-server, or a cluster; emptied after each test (chunks and ledgers)."""
    target = request.getfixturevalue(request.param)
    yield target.url
    nodes = target.nodes if isinstance(target, RedisClusterServers) else [target]
    for node in nodes:
        with node.client() as client:
            client.flushall()


def chunks(n: int) -> str:
    return f"{n * UNIT}B"


def open_tiers(
    url: str,
    rows: dict[str, str],
    count: int = 1,
    fingerprints: list[Fingerprint] | None = None,
    **options: object,
) -> list[RedisTier]:
    """``count`` tiers on ``url`` (of ``fingerprints``, else all of the contract's), each with
    its own quota table of ``rows`` (an engine each, as a fleet is)."""
    tiers = []
    for i in range(count):
        opts = RedisOptions(**{"timeout_s": 2.0, **options})  # type: ignore[arg-type]
        fingerprint = fingerprints[i] if fingerprints else FINGERPRINT
        tier = RedisTier(parse_remote_url(url), fingerprint.layout, fingerprint, opts)
        table = {t: parse_limit("tenant_quotas", v) for t, v in rows.items()}
        tier.attach_quotas(TenantQuotas(table))
        tier.open()
        tiers.append(tier)
    return tiers


def store(tier: RedisTier, tenant: str, seed: int) -> ChunkKey:
    key = seed.to_bytes(16, "big")
    assert put_as(tier, tenant, key, payload(CONTRACT_CHUNK, seed), CONTRACT_CHUNK).outcome is (
        PutOutcome.STORED
    )
    return key


def live(tier: RedisTier, keys: list[ChunkKey]) -> list[ChunkKey]:
    return [k for k, held in zip(keys, tier.contains(keys), strict=True) if held]


def delete_behind_the_tiers_back(tier: RedisTier, key: ChunkKey) -> bool:
    name = tier.store.name_of(key)
    return bool(tier.store.link.call(lambda client: client.delete(name)))


def test_a_flood_from_two_engines_stays_within_its_quota_fleet_wide(url: str) -> None:
    a, b = open_tiers(url, {"flood": chunks(4)}, count=2)
    try:
        calm = [store(a, "calm", seed) for seed in range(1, 4)]
        flood = []
        for seed in range(100, 120):  # 20 chunks, the two engines taking turns
            flood.append(store(a if seed % 2 else b, "flood", seed))
        assert live(a, flood) == flood[-4:]  # its newest 4, whichever engine stored them
        assert live(b, calm) == calm  # another tenant's chunks are untouched
        reports = [tenant_rows(a), tenant_rows(b)]
        for report in reports:  # the ledger's count is the fleet's, read by each engine
            assert report["flood"]["held_bytes"] == 4 * UNIT
            assert report["flood"]["limit_bytes"] == 4 * UNIT
        assert "calm" not in reports[1]  # an engine reports the tenants it stored for
        assert reports[0]["calm"]["chunks"] == 3
        assert reports[0]["calm"]["limit_bytes"] is None
        assert reports[0]["calm"]["quota_evictions"] == 0
        assert sum(r["flood"]["quota_evictions"] or 0 for r in reports) == 16
        assert a.counters.evicted + b.counters.evicted == 16
        gone = {**a.tenants.evicted_by_quota(flood), **b.tenants.evicted_by_quota(flood)}
        assert gone == dict.fromkeys(flood[:16], "flood")  # kvtier explain names the quota
        assert a.get_into(flood[-1], _page()) == CONTRACT_CHUNK  # what is left still reads
    finally:
        a.close()
        b.close()


def test_salts_under_the_star_row_share_one_ledger_fleet_wide(server: RedisServer) -> None:
    """A client that sends a new cache_salt with each request gets the "*" row once: the
    sprayed salts together keep the row's 3 chunks, whichever engine stored them."""
    a, b = open_tiers(server.url, {"alice": chunks(4), "*": chunks(3)}, count=2)
    try:
        alice = [store(a, "alice", seed) for seed in range(1, 5)]
        sprayed = [store(a if seed % 2 else b, f"salt{seed}", seed) for seed in range(10, 30)]
        assert live(a, sprayed) == sprayed[-3:]  # per salt, every one would have stayed
        assert live(b, alice) == alice
        report = tenant_rows(a)
        assert report["*"]["chunks"] == 3 and report["*"]["limit_bytes"] == 3 * UNIT
        assert not any(name.startswith("salt") for name in report)  # one row: the ledger's
        gone = {**a.tenants.evicted_by_quota(sprayed), **b.tenants.evicted_by_quota(sprayed)}
        assert gone == dict.fromkeys(sprayed[:-3], "*")
    finally:
        a.close()
        b.close()
        with server.client() as client:  # the server is shared: leave no ledger behind
            client.flushall()


def _page() -> torch.Tensor:
    return torch.empty(UNIT, dtype=torch.uint8)


def test_the_tp_ranks_of_a_model_share_a_tenants_limit(url: str) -> None:
    """Each rank writes its own chunks (its own fingerprint); a share of Redis is of all of
    it, so the ranks of one world count against one ledger, as each rank's CPU tier is
    bounded in its own memory."""
    ranks = [dataclasses.replace(FINGERPRINT, tp_rank=r, tp_world_size=2) for r in (0, 1)]
    r0, r1 = open_tiers(url, {"t": chunks(4)}, count=2, fingerprints=ranks)
    try:
        keys0 = [store(r0, "t", seed) for seed in range(1, 4)]
        keys1 = [store(r1, "t", seed) for seed in range(1, 4)]  # same keys, the other rank
        assert live(r0, keys0) == keys0[2:] and live(r1, keys1) == keys1  # 4 in all
        report0, report1 = tenant_rows(r0)["t"], tenant_rows(r1)["t"]
        assert report0["chunks"] == report1["chunks"] == 4
        assert report1["quota_evictions"] == 2  # rank 0's two oldest, deleted by rank 1
        assert (
            r1.tenants.evicted_by_quota(keys1) == {}
        )  # not rank 1's keys: not reported as its own
    finally:
        r0.close()
        r1.close()


def test_without_scripts_the_ledger_is_a_transaction_and_holds_as_well(url: str) -> None:
    a, b = open_tiers(url, {"flood": chunks(3)}, count=2)
    try:
        for tier in (a, b):  # as after a server refused EVAL
            assert tier.ledger is not None
            tier.ledger._use_script = False
        calm = [store(a, "calm", 1)]
        flood = [store(a if seed % 2 else b, "flood", seed) for seed in range(100, 110)]
        assert live(a, flood) == flood[-3:]
        assert live(a, calm) == calm
        assert tenant_rows(a)["flood"]["chunks"] == 3
    finally:
        a.close()
        b.close()


def test_a_server_that_refuses_eval_gets_the_transaction() -> None:
    srv = RedisServer(extra_args=("--rename-command", "EVAL", ""))  # as some services do
    try:
        srv.start()
        (tier,) = open_tiers(srv.url, {"t": chunks(2)})
        try:
            keys = [store(tier, "t", seed) for seed in range(1, 5)]
            assert tier.ledger is not None and not tier.ledger._use_script
            assert live(tier, keys) == keys[-2:]
        finally:
            tier.close()
    finally:
        srv.cleanup()


def test_a_limit_changed_at_run_time_applies_at_once_and_at_the_next_store(url: str) -> None:
    (tier,) = open_tiers(url, {"t": chunks(6)})
    try:
        keys = [store(tier, "t", seed) for seed in range(1, 7)]
        assert live(tier, keys) == keys
        tier.ledger.quotas.set("t", TenantLimit(nbytes=2 * UNIT))  # type: ignore[union-attr]
        assert live(tier, keys) == keys[-2:]  # PUT /quota: evicted before it answers
        tier.ledger.quotas.set("t", None)  # type: ignore[union-attr]
        keys += [store(tier, "t", seed) for seed in range(7, 10)]  # no row: no limit
        assert len(live(tier, keys)) == 5
    finally:
        tier.close()


def test_chunks_redis_dropped_itself_cost_the_tenant_none_of_its_live_ones(url: str) -> None:
    (tier,) = open_tiers(url, {"t": chunks(4)})
    try:
        keys = [store(tier, "t", seed) for seed in range(1, 5)]
        for gone in (keys[0], keys[2]):  # as maxmemory eviction or an expiry would
            assert delete_behind_the_tiers_back(tier, gone)
        # Pops keys[0]: gone already, so a stale member, and the look-ahead finds keys[2].
        keys.append(store(tier, "t", 5))
        keys.append(store(tier, "t", 6))  # 4 members again: nothing popped
        assert live(tier, keys) == [keys[1], keys[3], keys[4], keys[5]]  # 4: its limit
        row = tenant_rows(tier)["t"]
        assert row["quota_evictions"] == 0
        assert row["stale_entries"] == 2
    finally:
        tier.close()


def test_a_share_is_of_maxmemory(server: RedisServer) -> None:
    with server.client() as client:
        client.config_set("maxmemory", str(1000 * UNIT))
    try:
        (tier,) = open_tiers(server.url, {"*": "0.5%"})  # 5 chunks of 1000
        keys = [store(tier, "anyone", seed) for seed in range(1, 9)]
        assert live(tier, keys) == keys[-5:]
        assert tenant_rows(tier)["*"]["limit_bytes"] == 5 * UNIT  # its row's one ledger
        tier.close()
    finally:
        with server.client() as client:
            client.config_set("maxmemory", "0")
            client.flushall()


def test_the_ledger_expires_with_the_chunks_it_counts(server: RedisServer) -> None:
    (tier,) = open_tiers(server.url, {"t": chunks(4)}, ttl_s=60.0)
    try:
        store(tier, "t", 1)
        with server.client() as client:
            ttl_ms = client.pttl(ledger_name(tier.fingerprint.hex(), "t"))
            assert 0 < ttl_ms <= 60_000
            assert client.pttl(tier.store.name_of((1).to_bytes(16, "big"))) <= ttl_ms
    finally:
        tier.close()
        with server.client() as client:
            client.flushall()


def test_a_limit_under_one_chunk_is_refused_naming_the_tenant(server: RedisServer) -> None:
    (tier,) = open_tiers(server.url, {"tiny": "1KiB"})
    try:
        key = (1).to_bytes(16, "big")
        result = put_as(tier, "tiny", key, payload(CONTRACT_CHUNK, 1), CONTRACT_CHUNK)
        assert result.outcome is PutOutcome.DROPPED
        assert "tenant 'tiny'" in result.detail and "1.00 KiB" in result.detail
        assert f"below one chunk ({UNIT} bytes)" in result.detail
        assert tier.contains([key]) == [False]
    finally:
        tier.close()
    with pytest.raises(ConfigError, match=r"tenant_quotas\['bob'\].*150%.*above 0 up to 100"):
        small_config(remote_url=server.url, tenant_quotas={"bob": "150%"})


def test_engine_reports_the_remote_tiers_tenants_in_stats_and_metrics(
    server: RedisServer,
) -> None:
    prompt = 4 * SMALL_CHUNK
    unit = records.header_size() + SMALL_LAYOUT.payload_bytes(SMALL_CHUNK)
    config = small_config(
        cpu_chunks=64, remote_url=server.url, tenant_quotas={"flood": f"{2 * unit}B"}
    )
    try:
        with Engine(config, SMALL_LAYOUT, model_name="m") as engine:
            for seed in range(1, 4):  # 12 chunks of "flood": 2 stay in Redis
                engine.store(make_tokens(prompt, seed), make_kv(prompt, seed), cache_salt="flood")
            engine.store(make_tokens(prompt, 9), make_kv(prompt, 9), cache_salt="calm")
            engine.flush()
            tenants = engine.stats()["tiers"]["redis"]["tenants"]
            assert tenants["flood"]["held_bytes"] == 2 * unit
            assert tenants["flood"]["quota_evictions"] == 10
            assert tenants["calm"]["chunks"] == 4
            value = engine_registry(engine).get_sample_value
            labels = {"tier": "redis", "tenant": "flood"}
            assert value("kvtier_tenant_held_bytes", labels) == 2 * unit
            assert value("kvtier_tenant_limit_bytes", labels) == 2 * unit
            assert value("kvtier_tenant_quota_evictions_total", labels) == 10
            assert value("kvtier_tenant_hit_chunks_total", labels) is None  # unknown here
    finally:
        with server.client() as client:
            client.flushall()


def test_two_kvtier_servers_on_one_redis_hold_a_flood_to_its_quota_together(
    server: RedisServer,
) -> None:
    """Two hosts' ``kvtier server`` processes (a fleet) share one Redis; their clients' requests
    are tenants by cache_salt. A flood stored through both servers stays within its quota in
    Redis, and the quiet tenant keeps every chunk."""
    unit = records.header_size() + SMALL_LAYOUT.payload_bytes(SMALL_CHUNK)
    prompt = 4 * SMALL_CHUNK
    config = {
        "max_local_cpu_size": f"{64 * SMALL_LAYOUT.chunk_bytes(SMALL_CHUNK)}B",
        "remote_url": server.url,
        "tenant_quotas": {"flood": f"{3 * unit}B"},
    }
    directories = [short_tempdir(), short_tempdir()]
    servers = [ServerProcess(d, **config).start() for d in directories]
    clients = [open_client(s.url) for s in servers]
    try:
        clients[0].store(make_tokens(prompt, 1), make_kv(prompt, 1), cache_salt="quiet")
        for seed in range(10, 16):  # 24 chunks of "flood", the two hosts taking turns
            kv = make_kv(prompt, seed)
            clients[seed % 2].store(make_tokens(prompt, seed), kv, cache_salt="flood")
        for client in clients:
            assert client.flush(30.0)
        with server.client() as raw:
            chunks = set(raw.scan_iter(match=b"kvtier:*"))
            ledgers = set(raw.scan_iter(match=b"kvtier-tenant:*"))
            assert len(ledgers) == 2  # flood's and quiet's, under the model's fingerprint
            flood = next(n for n in ledgers if n.endswith(b":" + b"flood".hex().encode()))
            assert raw.zcard(flood) == 3
            assert len(chunks) == 4 + 3  # quiet's 4 and the flood's newest 3
        tenants = [c.stats()["tiers"]["redis"]["tenants"] for c in clients]
        assert all(t["flood"]["held_bytes"] == 3 * unit for t in tenants)
        assert sum(t["flood"]["quota_evictions"] or 0 for t in tenants) == 21
        assert tenants[0]["quiet"]["chunks"] == 4
    finally:
        for client in clients:
            client.close()
        for proc, directory in zip(servers, directories, strict=True):
            proc.stop()
            remove_tempdir(directory)
        with server.client() as raw:
            raw.flushall()


def test_put_quota_through_the_admin_api_trims_the_tenant_in_redis_at_once(
    server: RedisServer, service_factory: Callable[..., Service]
) -> None:
    unit = records.header_size() + SMALL_LAYOUT.payload_bytes(SMALL_CHUNK)
    prompt = 4 * SMALL_CHUNK
    # "big" has a row from the start: a salt under "*" is counted in the row's one ledger,
    # and one that gains a row counts from its next store (redis/quotas.py's docstring)
    rows = {"*": "100%", "big": "100%"}
    service = open_service(service_factory, remote_url=server.url, tenant_quotas=rows)
    url, engine = service.admin_url or "", service.engine
    try:
        for seed in range(1, 4):
            engine.store(make_tokens(prompt, seed), make_kv(prompt, seed), cache_salt="big")
        assert engine.flush(10.0)
        bad = call(url, "/quota?tenant=big&limit=-3GiB", method="PUT", token=TOKEN)
        assert bad.status == 400 and "-3GiB" in bad.json()["error"]  # refused, named
        reply = call(url, f"/quota?tenant=big&limit={5 * unit}B", method="PUT", token=TOKEN)
        assert reply.status == 200, reply.body
        listing = call(url, "/quotas", token=TOKEN).json()
        assert listing["tiers"]["redis"]["big"]["held_bytes"] == 5 * unit  # before it answered
        assert listing["tiers"]["redis"]["big"]["quota_evictions"] == 7
        with server.client() as raw:
            assert len(list(raw.scan_iter(match=b"kvtier:*"))) == 5
    finally:
        with server.client() as raw:
            raw.flushall()


class TestRedisTenantContract(TenantContract):
    """A cap and the fleet's ledger (no guarantee of its own: another tenant's flood deletes
    only its own chunks, so the quiet tenant's stay), on a server and on a cluster."""

    unit_bytes = UNIT

    @pytest.fixture
    def tenant_tier(self, url: str) -> Iterator[TenantTierFactory]:
        made: list[RedisTier] = []

        def make(quotas: TenantQuotas) -> RedisTier:
            options = RedisOptions(timeout_s=2.0)
            tier = RedisTier(parse_remote_url(url), FINGERPRINT.layout, FINGERPRINT, options)
            tier.attach_quotas(quotas)
            tier.open()
            made.append(tier)
            return tier

        yield make
        for tier in made:
            tier.close()
