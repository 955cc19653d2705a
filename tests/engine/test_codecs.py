"""An engine whose disk tier writes with a codec: a lossless disk hit is the KV bit for bit,
a lossy one is close, and an engine configured with another codec does not take the lossy
chunks of the same directory as its own (it misses; lossless chunks it reads)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvtier.engine import Engine
from tests.conftest import make_kv, make_tokens

EngineFactory = Callable[..., Engine]


def disk_hit(engine_factory: EngineFactory, path: Path, codec: str) -> torch.Tensor | None:
    """Store 48 tokens, drop them from the CPU tier, load them from disk (None: a miss)."""
    engine = engine_factory(local_disk=str(path), max_local_disk_size="1MiB", disk_codec=codec)
    tokens = make_tokens(48)
    engine.store(tokens, make_kv(48))
    assert engine.flush(10.0)
    return reread(engine_factory, path, codec, tokens)


def reread(
    engine_factory: EngineFactory, path: Path, codec: str, tokens: list[int]
) -> torch.Tensor | None:
    engine = engine_factory(local_disk=str(path), max_local_disk_size="1MiB", disk_codec=codec)
    hit = engine.lookup(tokens, "r")
    try:
        if hit.tokens == 0:
            return None
        assert hit.tokens == 48 and hit.cpu_tokens == 0
        return engine.retrieve(tokens, "r")
    finally:
        engine.end_request("r")
        assert engine.check_invariants() == []


@pytest.mark.parametrize("codec", ["lossless", "fp8", "int8"])
def test_a_disk_hit_through_a_codec(
    engine_factory: EngineFactory, tmp_path: Path, codec: str
) -> None:
    kv = disk_hit(engine_factory, tmp_path, codec)
    assert kv is not None
    want = make_kv(48)
    if codec == "lossless":
        assert torch.equal(kv, want)
    else:
        assert float((kv - want).norm() / want.norm()) < 0.05
    # Another codec config over the same directory: lossless chunks are shared, lossy not.
    other = reread(engine_factory, tmp_path, "identity", make_tokens(48))
    assert (other is not None) == (codec == "lossless")
