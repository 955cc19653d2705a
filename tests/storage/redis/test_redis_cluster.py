"""The redis tier against a real 3-master Redis Cluster (started once for this module)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvtier import Engine
from kvtier.storage.redis.tier import RedisTier
from tests.conftest import SMALL_LAYOUT, make_kv, make_tokens, small_config
from tests.redis_servers import RedisClusterServers
from tests.storage.redis.test_redis import open_tier
from tests.storage.tier_contract import (
    CONTRACT_CHUNK,
    PAGE_BYTES,
    TierContract,
    payload,
    put_and_wait,
    random_key,
)


class TestRedisClusterTierContract(TierContract):
    @pytest.fixture
    def tier(self, cluster: RedisClusterServers) -> Iterator[RedisTier]:
        tier = open_tier(cluster.url)
        yield tier
        tier.clear()
        tier.close()


@pytest.fixture
def tier(cluster: RedisClusterServers) -> Iterator[RedisTier]:
    tier = open_tier(cluster.url)
    yield tier
    tier.clear()
    tier.close()


def test_chunks_spread_over_every_master(tier: RedisTier, cluster: RedisClusterServers) -> None:
    keys = [random_key() for _ in range(30)]
    for i, key in enumerate(keys):
        put_and_wait(tier, key, payload(CONTRACT_CHUNK, i), CONTRACT_CHUNK)
    per_node = {node.port: 0 for node in cluster.nodes}
    for node in cluster.nodes:
        with node.client() as raw:
            per_node[node.port] = sum(1 for _ in raw.scan_iter(match=tier.store.prefix + b"*"))
    assert sum(per_node.values()) == len(keys)
    assert all(count > 0 for count in per_node.values()), per_node
    assert b"{" not in tier.store.name_of(keys[0])  # no hash tag pinning them to one slot
    assert tier.contains(keys) == [True] * len(keys)
    assert tier.usage().entries >= len(keys)


def test_any_single_master_is_enough_to_start(cluster: RedisClusterServers) -> None:
    tier = open_tier(f"valkey-cluster://127.0.0.1:{cluster.nodes[1].port}")
    try:
        assert tier.store.link.is_up
        key = random_key()
        put_and_wait(tier, key, payload(CONTRACT_CHUNK, 3), CONTRACT_CHUNK)
        out = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
        assert tier.get_into(key, out) == CONTRACT_CHUNK
        holder = cluster.node_holding(tier.store.name_of(key))
        with holder.client() as raw:
            assert raw.exists(tier.store.name_of(key)) == 1
    finally:
        tier.clear()
        tier.close()


def test_engines_share_a_cache_through_the_cluster(cluster: RedisClusterServers) -> None:
    tokens, kv = make_tokens(96, seed=21), make_kv(96, seed=21)
    config = small_config(remote_url=cluster.url)
    with Engine(config, SMALL_LAYOUT, model_name="m") as writer:
        assert writer.store(tokens, kv) == 6
        assert writer.flush(10.0)
    with Engine(config, SMALL_LAYOUT, model_name="m") as reader:
        assert reader.lookup(tokens, "r").tokens == 96
        assert torch.equal(reader.retrieve(tokens, "r"), kv)
        reader.end_request("r")
        assert reader.check_invariants() == [] and reader.leaks() == []
        for lower in reader.tiers()[1:]:  # below the CPU tier
            lower.clear()
