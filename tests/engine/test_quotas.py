"""Per-tenant quotas through the engine: a request's cache_salt is its tenant, from store into
the CPU tier's bookkeeping, and stats() and the metrics show each tenant."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import pytest

from kvtier import Engine
from kvtier.errors import ConfigError, InputError
from kvtier.observability.metrics import engine_registry
from kvtier.request_salt import ExtraKeys
from tests.conftest import SMALL_CHUNK, SMALL_LAYOUT, make_kv, make_tokens, small_config

CHUNK_BYTES = SMALL_LAYOUT.chunk_bytes(SMALL_CHUNK)
PROMPT = 4 * SMALL_CHUNK


def test_a_flooding_salt_stays_within_its_quota_and_the_others_keep_their_chunks(
    engine_factory: Callable[..., Engine],
) -> None:
    engine = engine_factory(cpu_chunks=16, tenant_quotas={"flood": "25%", "*": "50%"})
    quiet = make_tokens(PROMPT, 1)
    engine.store(quiet, make_kv(PROMPT, 1), cache_salt="quiet")
    for seed in range(10, 30):  # 20 prompts of 4 chunks: five times the whole tier
        engine.store(make_tokens(PROMPT, seed), make_kv(PROMPT, seed), cache_salt="flood")
    tenants = engine.stats()["tiers"]["cpu"]["tenants"]
    assert tenants["flood"]["held_bytes"] == 4 * CHUNK_BYTES  # 25 % of 16 pages
    assert tenants["flood"]["quota_evictions"] == 76
    assert tenants["flood"]["guarantee_bytes"] == 0  # 76 lost, none used: it lapsed
    assert tenants["quiet"] == {
        "held_bytes": 4 * CHUNK_BYTES,
        "limit_bytes": 8 * CHUNK_BYTES,
        "guarantee_bytes": 8 * CHUNK_BYTES,
        "chunks": 4,
        "hits": 0,
        "evictions": 0,
        "quota_evictions": 0,
    }
    with engine.request("r"):
        assert engine.lookup(quiet, "r", cache_salt="quiet").tokens == PROMPT
    assert engine.stats()["tiers"]["cpu"]["tenants"]["quiet"]["hits"] == 4
    assert engine.check_invariants() == []

    registry = engine_registry(engine)
    value = registry.get_sample_value
    assert value("kvtier_tenant_held_bytes", {"tier": "cpu", "tenant": "flood"}) == 4 * CHUNK_BYTES
    assert value("kvtier_tenant_quota_evictions_total", {"tier": "cpu", "tenant": "flood"}) == 76
    assert value("kvtier_tenant_hit_chunks_total", {"tier": "cpu", "tenant": "quiet"}) == 4
    assert value("kvtier_tenant_limit_bytes", {"tier": "cpu", "tenant": "quiet"}) == 8 * CHUNK_BYTES
    assert value("kvtier_tenant_guarantee_bytes", {"tier": "cpu", "tenant": "flood"}) == 0


def test_a_request_pinning_its_prefix_keeps_it_over_its_quota(
    engine_factory: Callable[..., Engine],
) -> None:
    engine = engine_factory(cpu_chunks=16, tenant_quotas={"t": "25%"})
    first = make_tokens(PROMPT, 1)
    engine.store(first, make_kv(PROMPT, 1), cache_salt="t")
    with engine.request("reader"):
        assert engine.lookup(first, "reader", cache_salt="t").tokens == PROMPT  # pinned
        engine.store(make_tokens(PROMPT, 2), make_kv(PROMPT, 2), cache_salt="t")
        kv = engine.retrieve(first, "reader", cache_salt="t")
        assert kv.equal(make_kv(PROMPT, 1))  # the pinned prefix stayed, byte for byte
        assert engine.stats()["tiers"]["cpu"]["tenants"]["t"]["held_bytes"] == 4 * CHUNK_BYTES
    assert engine.check_invariants() == []


def test_without_tenant_quotas_stats_show_no_tenants(engine: Engine) -> None:
    engine.store(make_tokens(PROMPT), make_kv(PROMPT), cache_salt="a")
    assert "tenants" not in engine.stats()["tiers"]["cpu"]


def test_quotas_with_a_codec_whose_chunks_vary_in_size_are_refused_by_name() -> None:
    config = small_config(cpu_chunks=16, tenant_quotas={"*": "50%"}, cpu_codec="lossless")
    with pytest.raises(ConfigError, match=r"tenant_quotas.*cpu_codec"):
        Engine(config, SMALL_LAYOUT, model_name="m").open()


@pytest.mark.parametrize("codec", ["fp8", "int8"])
def test_a_flooding_salt_stays_within_its_quota_in_a_coded_cpu_tier(codec: str) -> None:
    """A fixed-size codec's chunk is one slot of its store: the quota counts slots as it
    counts pages, through the same insert and eviction as the plain tier."""
    config = small_config(cpu_chunks=16, tenant_quotas={"flood": "25%"}, cpu_codec=codec)
    with Engine(config, SMALL_LAYOUT, model_name="m") as engine:
        cpu = engine.tier("cpu")
        assert cpu is not None
        quiet = make_tokens(PROMPT, 1)
        engine.store(quiet, make_kv(PROMPT, 1), cache_salt="quiet")
        for seed in range(10, 30):
            engine.store(make_tokens(PROMPT, seed), make_kv(PROMPT, seed), cache_salt="flood")
        tenants = engine.stats()["tiers"]["cpu"]["tenants"]
        flood = tenants["flood"]
        assert flood["held_bytes"] <= flood["limit_bytes"] and flood["quota_evictions"] > 0
        assert flood["limit_bytes"] == cpu.usage().capacity_bytes // 4
        with engine.request("r"):  # the other tenant kept its chunks
            assert engine.lookup(quiet, "r", cache_salt="quiet").tokens == PROMPT
        assert engine.check_invariants() == []


def test_a_lora_adapters_requests_without_a_salt_are_its_own_tenant(
    engine_factory: Callable[..., Engine],
) -> None:
    engine = engine_factory(cpu_chunks=16, tenant_quotas={"lora:sql": "25%"})
    adapter = ExtraKeys(adapter=b"\x01" * 32, labels=("lora adapter 'sql'",), tenant="lora:sql")
    for seed in range(4):
        engine.store(make_tokens(PROMPT, seed), make_kv(PROMPT, seed), cache_salt=adapter)
    salted = msgspec.structs.replace(adapter, salt="acme")  # a salt wins: acme's share
    engine.store(make_tokens(PROMPT, 9), make_kv(PROMPT, 9), cache_salt=salted)
    tenants = engine.stats()["tiers"]["cpu"]["tenants"]
    assert tenants["lora:sql"]["held_bytes"] == 4 * CHUNK_BYTES  # its 25 %, of 16 stored
    assert tenants["lora:sql"]["quota_evictions"] == 12
    assert tenants["acme"]["chunks"] == 4
    with pytest.raises(InputError, match=r"ExtraKeys\.tenant"):
        engine.store(
            make_tokens(PROMPT),
            make_kv(PROMPT),
            cache_salt=ExtraKeys(adapter=b"\x01" * 32, tenant="x" * 2000),
        )
