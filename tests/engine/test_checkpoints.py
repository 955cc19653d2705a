"""A lookup that ends at an earlier prompt's checkpoint (``checkpoint_tokens``): the
partial chunk it stored, found by probing the chunk the lookup misses, in the CPU tier, on
disk and in Redis; the bytes served are the bytes stored, and every pin is given back."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import Engine, InputError
from kvtier.cache import KVCache
from kvtier.engine._checkpoints import checkpoint_ends
from tests.conftest import SMALL_CHUNK, SMALL_LAYOUT, make_kv, make_tokens, small_config
from tests.redis_servers import RedisServer

UNIT = 4  # a checkpoint every 4 tokens (vLLM's block, for a state model)
EngineFactory = Callable[..., Engine]


def test_checkpoints_inside_the_missed_chunk_longest_first() -> None:
    assert checkpoint_ends(16, 44, 16, 4) == [28, 24, 20]
    assert checkpoint_ends(16, 26, 16, 4) == [24, 20]  # before the prompt's own end
    assert checkpoint_ends(16, 24, 16, 4) == [20]
    assert checkpoint_ends(20, 44, 16, 4) == []  # a hit at a checkpoint is already one
    assert checkpoint_ends(32, 32, 16, 4) == []  # the whole prompt hit


def tier_config(tier: str, tmp_path: Path, redis_server: RedisServer | None) -> dict[str, Any]:
    """The hit comes from ``tier`` alone: a lower tier is read with the CPU as staging."""
    if tier == "cpu":
        return {}
    lower: dict[str, Any] = (
        {"local_disk": str(tmp_path / "disk"), "max_local_disk_size": "1MiB"}
        if tier == "disk"
        else {"remote_url": redis_server.url if redis_server else ""}
    )
    return {"local_cpu": False, "use_only_staging_buffer": True, **lower}


def next_turn_resumes_at_the_checkpoint(
    cache: KVCache, first: list[int], kv: torch.Tensor, turn: list[int]
) -> None:
    """``first`` (a chunk and a checkpoint) is cached; ``turn`` extends it past that chunk:
    a plain lookup stops at the chunk, one with checkpoints reaches ``first``'s end, and the
    KV loaded is ``kv``."""
    with cache.request("plain"):
        assert cache.lookup(turn, "plain").tokens == SMALL_CHUNK
    out = torch.zeros(SMALL_LAYOUT.kv_shape(len(turn)))
    with cache.request("turn"):
        assert cache.lookup(turn, "turn", checkpoint_tokens=UNIT).tokens == len(first)
        assert cache.retrieve_into(turn, "turn", out) == len(first)
    assert torch.equal(out[:, :, : len(first)], kv)


@pytest.mark.parametrize("tier", ["cpu", "disk", "redis"])
def test_a_longer_prompt_resumes_at_the_earlier_prompts_checkpoint(
    tier: str,
    engine_factory: EngineFactory,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    redis = request.getfixturevalue("redis_server") if tier == "redis" else None
    engine = engine_factory(save_unfull_chunk=True, **tier_config(tier, tmp_path, redis))
    first = make_tokens(SMALL_CHUNK + 2 * UNIT)  # a chunk, and a checkpoint 8 tokens on
    kv = make_kv(len(first))
    assert engine.store(first, kv) == 2
    assert engine.flush(10.0)
    next_turn_resumes_at_the_checkpoint(engine, first, kv, first + make_tokens(20, seed=1))
    assert engine.stats()["hit_tokens_by_tier"].get(tier, 0) == len(first)  # all from it
    assert engine.leaks() == [] and engine.check_invariants() == []


def test_only_the_same_prefix_and_salt_find_a_checkpoint(engine_factory: EngineFactory) -> None:
    engine = engine_factory(save_unfull_chunk=True)
    first = make_tokens(SMALL_CHUNK + 2 * UNIT)
    engine.store(first, make_kv(len(first)), cache_salt="tenant-a")
    turn = first + make_tokens(20, seed=1)
    other = first[:-1] + [first[-1] + 1] + make_tokens(20, seed=1)  # differs in the checkpoint
    for rid, tokens, salt, hit in (
        ("same", turn, "tenant-a", len(first)),
        ("other-salt", turn, "tenant-b", 0),
        ("no-salt", turn, None, 0),
        ("other-tokens", other, "tenant-a", SMALL_CHUNK),
    ):
        with engine.request(rid):
            found = engine.lookup(tokens, rid, cache_salt=salt, checkpoint_tokens=UNIT)
            assert found.tokens == hit, rid
    assert engine.leaks() == [] and engine.check_invariants() == []


def test_checkpoint_tokens_must_divide_the_chunk(engine: Engine) -> None:
    tokens = make_tokens(40)
    with pytest.raises(InputError, match="checkpoint_tokens 5 does not divide chunk_size 16"):
        engine.lookup(tokens, "r", checkpoint_tokens=5)
    with pytest.raises(InputError, match="checkpoint_tokens must be an int >= 0"):
        engine.lookup(tokens, "r", checkpoint_tokens=-4)
    assert engine.leaks() == []


@settings(max_examples=40, deadline=None)
@given(
    stored=st.lists(st.integers(1, 3 * SMALL_CHUNK), min_size=1, max_size=4),
    looked=st.lists(st.integers(2, 4 * SMALL_CHUNK), min_size=1, max_size=4),
)
def test_every_hit_ends_where_a_record_ends_and_pins_come_back(
    stored: list[int], looked: list[int]
) -> None:
    """Prefixes of one token sequence stored (each with its partial tail), then looked up
    with checkpoints: a hit ends at a chunk end or at the end of a stored prefix, never
    past the prompt, and the KV served is the stored KV; with every request ended, no pin
    is left."""
    base = make_tokens(4 * SMALL_CHUNK)
    kv = make_kv(len(base))
    engine = Engine(
        small_config(save_unfull_chunk=True, cpu_chunks=32), SMALL_LAYOUT, model_name="m"
    ).open()
    try:
        for n in stored:
            engine.store(base[:n], kv[:, :, :n])
        ends = {n for n in stored if n % SMALL_CHUNK}
        for i, n in enumerate(looked):
            rid = f"r{i}"
            hit = engine.lookup(base[:n], rid, checkpoint_tokens=UNIT).tokens
            assert hit <= n
            assert hit % SMALL_CHUNK == 0 or (hit in ends and hit % UNIT == 0) or hit == n
            out = torch.zeros(SMALL_LAYOUT.kv_shape(n))
            loaded = engine.retrieve_into(base[:n], rid, out)
            assert loaded == hit and torch.equal(out[:, :, :loaded], kv[:, :, :loaded])
        for i in range(len(looked)):
            engine.end_request(f"r{i}")
        assert engine.leaks() == [] and engine.check_invariants() == []
    finally:
        engine.close()
