"""``cache_policy`` reaches the CPU tier an engine opens (``tiers.open_storage``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvtier import Engine
from tests.conftest import SMALL_CHUNK, make_kv, make_tokens


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
