"""What ``tiers.open_storage`` assembles: ``cache_policy`` reaches the CPU and disk tiers and
a CPU hit reaches the disk's eviction order; lower tiers handed to an Engine are used (and
owned) instead of the config's; the stats name each published tier's medium."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvtier import Engine
from kvtier.errors import InputError
from kvtier.service import Service
from kvtier.storage.cpu import CpuTier
from kvtier.storage.records import HEADER_SIZE
from tests.conftest import SMALL_CHUNK, SMALL_LAYOUT, make_kv, make_tokens, small_config
from tests.storage.dict_tier import DictTier, Store


@pytest.mark.parametrize(("policy", "kept_chunks"), [("LRU", 0), ("REUSE", 1)])
def test_the_configured_policy_chooses_the_cpu_victim(
    engine_factory: Callable[..., Engine], policy: str, kept_chunks: int
) -> None:
    engine = engine_factory(cpu_chunks=3, cache_policy=policy)
    first = make_tokens(2 * SMALL_CHUNK, seed=1)
    engine.store(first, make_kv(2 * SMALL_CHUNK, seed=1))
    engine.lookup(first, "use")  # both chunks used once, in prompt order
    engine.end_request("use")
    # two new chunks, one free page: one of first's chunks goes. LRU drops the least recently
    # used, the parent (the prompt is gone); REUSE drops the child and keeps the prefix.
    engine.store(make_tokens(2 * SMALL_CHUNK, seed=2), make_kv(2 * SMALL_CHUNK, seed=2))
    assert engine.lookup(first, "r").tokens == kept_chunks * SMALL_CHUNK
    engine.end_request("r")


def test_a_cpu_hit_keeps_the_disk_copy_from_being_the_next_victim(
    engine_factory: Callable[..., Engine], tmp_path: Path
) -> None:
    """CPU and disk both hold a chunk (the disk keeps a copy of everything stored). Hits
    served from CPU memory refresh the disk's copy too, so the disk does not evict the chunk
    used most just because its own reads never saw the use."""
    record = HEADER_SIZE + SMALL_LAYOUT.chunk_bytes(SMALL_CHUNK)
    engine = engine_factory(
        cpu_chunks=2,
        cache_policy="LRU",
        local_disk=str(tmp_path),
        max_local_disk_size=f"{3 * record}B",
    )
    prompts = [make_tokens(SMALL_CHUNK, seed=s) for s in range(4)]

    def store(i: int) -> None:
        engine.store(prompts[i], make_kv(SMALL_CHUNK, seed=i))
        assert engine.flush(10.0)

    store(0)
    store(1)
    assert engine.lookup(prompts[0], "hit").cpu_tokens == SMALL_CHUNK  # served from CPU
    engine.end_request("hit")
    store(2)  # CPU drops prompt 1; the disk holds 0, 1, 2 and is full
    store(3)  # CPU drops prompt 0; the disk drops its least recently used: 1, not 0
    assert engine.lookup(prompts[0], "again").tokens == SMALL_CHUNK
    assert engine.lookup(prompts[1], "gone").tokens == 0
    for rid in ("again", "gone"):
        engine.end_request(rid)


def injected(store: Store, **config: object) -> Engine:
    tier = DictTier(store)
    return Engine(small_config(**config), SMALL_LAYOUT, model_name="m", lower_tiers=[tier])


def test_an_injected_tier_serves_hits_through_the_engine() -> None:
    store: Store = {}  # shared by both engines' tiers, as a remote store is
    tokens, kv = make_tokens(3 * SMALL_CHUNK, seed=5), make_kv(3 * SMALL_CHUNK, seed=5)
    with injected(store) as writer:
        writer.store(tokens, kv)
        assert writer.flush(10.0)
    assert len(store) == 3  # every chunk reached the injected tier
    reader = injected(store).open()
    try:
        tier = reader.tier("dict")
        assert isinstance(tier, DictTier) and tier.state == "open"
        assert reader.lookup(tokens, "r").tokens == 3 * SMALL_CHUNK  # the CPU tier is empty
        got = reader.retrieve(tokens, "r")
        assert torch.equal(got, kv)
        reader.end_request("r")
        assert tier.counters.hits == 3
        assert reader.stats()["hit_tokens_by_tier"]["dict"] == 3 * SMALL_CHUNK
    finally:
        reader.close()
    assert tier.state == "closed"  # the engine closes what it was given


def test_injected_tiers_replace_the_config_tiers(tmp_path: Path) -> None:
    # a config naming a disk and an unregistered scheme: neither is read, nothing refused
    config = {"local_disk": str(tmp_path / "d"), "max_local_disk_size": "1MiB"}
    with injected({}, remote_url="nowhere://x", **config) as engine:
        assert engine.tier("disk") is None and isinstance(engine.tier("dict"), DictTier)
    assert not (tmp_path / "d").exists()


def test_a_service_passes_injected_tiers_to_its_engine() -> None:
    tier = DictTier()
    with Service(small_config(), SMALL_LAYOUT, model_name="m", lower_tiers=[tier]) as service:
        assert service.engine.tier("dict") is tier


@pytest.mark.parametrize(
    ("tiers", "why"),
    [
        ([DictTier(), DictTier()], "two tiers are named 'dict'"),
        ([CpuTier.__new__(CpuTier)], "named 'cpu'"),
        (["disk"], "not a Tier"),
    ],
)
def test_injected_tiers_are_tiers_with_their_own_names(tiers: list[object], why: str) -> None:
    with pytest.raises(InputError, match=why):
        Engine(small_config(), SMALL_LAYOUT, model_name="m", lower_tiers=tiers)  # type: ignore[arg-type]


def test_stats_name_the_medium_of_each_published_tier(
    engine_factory: Callable[..., Engine], tmp_path: Path
) -> None:
    engine = engine_factory(local_disk=str(tmp_path), max_local_disk_size="1MiB")
    assert engine.stats()["tier_media"] == {"cpu": "CPU", "disk": "DISK"}
    assert [t.medium for t in engine.tiers()] == ["CPU", "DISK"]
