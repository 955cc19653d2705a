"""``cache_policy`` reaches the tiers an engine opens (``tiers.open_storage``), and a CPU hit
reaches the disk's eviction order."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvtier import Engine
from kvtier.storage.records import HEADER_SIZE
from tests.conftest import SMALL_CHUNK, SMALL_LAYOUT, make_kv, make_tokens


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
    assert engine.lookup(first, "r") == kept_chunks * SMALL_CHUNK
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
