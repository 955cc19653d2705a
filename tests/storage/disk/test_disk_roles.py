"""The disk tier under a real Engine: restart survival, the three tier roles of DESIGN.md's
table (local_cpu / use_only_staging_buffer), and the chained prefix across CPU and disk."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvtier import Engine
from kvtier.storage.cpu import CpuTier
from kvtier.storage.disk.tier import DiskTier
from tests.conftest import SMALL_CHUNK, make_kv, make_tokens

Factory = Callable[..., Engine]
N_TOKENS = 3 * SMALL_CHUNK


def disk_engine(factory: Factory, path: Path, **overrides: Any) -> Engine:
    values: dict[str, Any] = {"local_disk": str(path), "max_local_disk_size": "1MiB"}
    values.update(overrides)
    return factory(**values)


def tiers(engine: Engine) -> tuple[CpuTier, DiskTier]:
    manager = engine._open_parts()[0]  # tests look inside on purpose
    assert manager is not None
    (disk,) = manager.lower
    assert isinstance(disk, DiskTier)
    return manager.cpu, disk


def keys_of(engine: Engine, tokens: list[int]) -> list[bytes]:
    return [s.key for s in engine.keychain.keys(tokens, include_partial=False)]


def assert_quiet(engine: Engine) -> None:
    """Invariant 1: after all requests end and writes land, nothing is pinned and every page
    is free or owned by a cache entry."""
    assert engine.flush(10)
    assert engine.check_invariants() == []
    assert engine.leaks() == []
    cpu, disk = tiers(engine)
    pool = cpu.pool
    assert pool.free_pages + len(cpu.owned_pages()) == pool.num_pages
    assert disk.counters.pinned_keys == 0


def test_store_close_reopen_hits_identical_bytes(engine_factory: Factory, tmp_path: Path) -> None:
    tokens, kv = make_tokens(N_TOKENS, 1), make_kv(N_TOKENS, 1)
    first = disk_engine(engine_factory, tmp_path)
    assert first.store(tokens, kv) == 3
    assert first.flush(10)
    first.close()

    second = disk_engine(engine_factory, tmp_path)
    with second.request("r1"):
        assert second.lookup(tokens, "r1").tokens == N_TOKENS
        assert torch.equal(second.retrieve(tokens, "r1"), kv)
    assert second.counters.hit_tokens_by_tier["disk"] == N_TOKENS
    assert tiers(second)[1].counters.batched_reads == 3  # one batch for the lookup
    assert_quiet(second)


def test_local_cpu_true_copies_a_disk_hit_back_to_cpu(
    engine_factory: Factory, tmp_path: Path
) -> None:
    tokens, kv = make_tokens(N_TOKENS, 2), make_kv(N_TOKENS, 2)
    writer = disk_engine(engine_factory, tmp_path)
    writer.store(tokens, kv)
    writer.close()

    engine = disk_engine(engine_factory, tmp_path, local_cpu=True)
    cpu, disk = tiers(engine)
    keys = keys_of(engine, tokens)
    assert cpu.contains(keys) == [False] * 3 and disk.contains(keys) == [True] * 3
    with engine.request("r1"):
        engine.lookup(tokens, "r1")
        assert all(disk.is_pinned(k) for k in keys)  # pinned for the request
        assert torch.equal(engine.retrieve(tokens, "r1"), kv)
    assert not any(disk.is_pinned(k) for k in keys)
    assert cpu.contains(keys) == [True] * 3  # copied back
    with engine.request("r2"):
        assert torch.equal(engine.retrieve(tokens, "r2"), kv)
    assert engine.counters.hit_tokens_by_tier == {"disk": N_TOKENS, "cpu": N_TOKENS}
    assert_quiet(engine)


def test_local_cpu_false_stages_in_cpu_visible_until_evicted_no_copy_back(
    engine_factory: Factory, tmp_path: Path
) -> None:
    tokens, kv = make_tokens(N_TOKENS, 3), make_kv(N_TOKENS, 3)
    engine = disk_engine(engine_factory, tmp_path, local_cpu=False, use_only_staging_buffer=False)
    cpu, disk = tiers(engine)
    keys = keys_of(engine, tokens)
    engine.store(tokens, kv)
    assert engine.flush(10)
    assert cpu.contains(keys) == [True] * 3 and disk.contains(keys) == [True] * 3
    with engine.request("r1"):
        assert torch.equal(engine.retrieve(tokens, "r1"), kv)
    assert engine.counters.hit_tokens_by_tier == {"cpu": N_TOKENS}  # CPU entries are visible

    cpu.clear()  # as if evicted: the next hit comes from disk, and is not copied back
    with engine.request("r2"):
        assert torch.equal(engine.retrieve(tokens, "r2"), kv)
        assert cpu.contains(keys) == [False] * 3
    assert engine.counters.hit_tokens_by_tier["disk"] == N_TOKENS
    assert cpu.contains(keys) == [False] * 3
    assert_quiet(engine)


def test_staging_only_cpu_is_never_looked_up_and_pages_come_back(
    engine_factory: Factory, tmp_path: Path
) -> None:
    tokens, kv = make_tokens(N_TOKENS, 4), make_kv(N_TOKENS, 4)
    engine = disk_engine(engine_factory, tmp_path, local_cpu=False, use_only_staging_buffer=True)
    cpu, disk = tiers(engine)
    keys = keys_of(engine, tokens)
    assert engine.store(tokens, kv) == 3
    assert engine.flush(10)
    # The completion callbacks gave every staging page back: nothing cached, nothing held.
    assert len(cpu) == 0
    assert cpu.pool.free_pages == cpu.pool.num_pages
    assert disk.contains(keys) == [True] * 3
    assert engine.counters.writes_by_tier["disk"]["stored"] == 3
    with engine.request("r1"):
        assert engine.lookup(tokens, "r1").tokens == N_TOKENS
        assert torch.equal(engine.retrieve(tokens, "r1"), kv)
        assert len(cpu) == 0  # a disk hit is not copied back
    with engine.request("r2"):
        assert torch.equal(engine.retrieve(tokens, "r2"), kv)
    assert engine.counters.hit_tokens_by_tier == {"disk": 2 * N_TOKENS}
    assert cpu.pool.free_pages == cpu.pool.num_pages
    assert_quiet(engine)


def test_staging_only_drops_a_store_when_every_page_is_in_flight(
    engine_factory: Factory, tmp_path: Path
) -> None:
    """A slow disk throttles stores instead of pinning all of CPU memory (LMCache #1285):
    with two staging pages, a store of many chunks stages what fits and drops the rest."""
    engine = disk_engine(
        engine_factory, tmp_path, local_cpu=False, use_only_staging_buffer=True, cpu_chunks=2
    )
    n = 12 * SMALL_CHUNK
    tokens, kv = make_tokens(n, 5), make_kv(n, 5)
    stored = engine.store(tokens, kv)
    assert 1 <= stored <= 12
    assert stored + engine.counters.dropped_chunks == 12
    assert_quiet(engine)
    cpu, _ = tiers(engine)
    assert cpu.pool.free_pages == 2
    with engine.request("r"):
        hit = engine.lookup(tokens, "r").tokens
        assert torch.equal(engine.retrieve(tokens, "r"), kv[:, :, :hit])
    assert_quiet(engine)


def test_chained_prefix_spans_cpu_and_disk(engine_factory: Factory, tmp_path: Path) -> None:
    tokens, kv = make_tokens(N_TOKENS, 6), make_kv(N_TOKENS, 6)
    engine = disk_engine(engine_factory, tmp_path)
    cpu, disk = tiers(engine)
    k0, k1, k2 = keys_of(engine, tokens)
    engine.store(tokens, kv)
    assert engine.flush(10)
    assert disk.remove(k0)  # chunk 0: CPU only
    assert cpu.remove(k1)  # chunk 1: disk only
    assert cpu.remove(k2) and disk.remove(k2)  # chunk 2: nowhere
    with engine.request("r1"):
        assert engine.lookup(tokens, "r1").tokens == 2 * SMALL_CHUNK
        assert torch.equal(engine.retrieve(tokens, "r1"), kv[:, :, : 2 * SMALL_CHUNK])
    assert engine.counters.hit_tokens_by_tier == {"cpu": SMALL_CHUNK, "disk": SMALL_CHUNK}

    assert cpu.remove(k0)  # chunk 0 nowhere: chunk 1 on disk no longer counts
    with engine.request("r2"):
        assert engine.lookup(tokens, "r2").tokens == 0
    assert_quiet(engine)


def test_a_corrupt_disk_chunk_ends_the_hit_and_is_recomputed(
    engine_factory: Factory, tmp_path: Path
) -> None:
    tokens, kv = make_tokens(N_TOKENS, 7), make_kv(N_TOKENS, 7)
    writer = disk_engine(engine_factory, tmp_path)
    writer.store(tokens, kv)
    writer.close()
    engine = disk_engine(engine_factory, tmp_path)
    _, disk = tiers(engine)
    k1 = keys_of(engine, tokens)[1]
    path = tmp_path / f"{engine.fingerprint.hex()}-{k1.hex()}.kvc"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with engine.request("r1"):
        assert engine.lookup(tokens, "r1").tokens == N_TOKENS  # headers look fine until read
        got = engine.retrieve(tokens, "r1")
    assert torch.equal(got, kv[:, :, :SMALL_CHUNK])  # served up to the bad chunk, never past
    assert disk.counters.corrupt == 1 and not path.exists()
    assert engine.counters.load_failures == 1
    assert_quiet(engine)
