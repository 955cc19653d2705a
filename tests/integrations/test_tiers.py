"""The oracle per tier: KV served from disk (after a restart) and from Redis (shared by two
engines) gives the same tokens and logits as recomputing it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.integrations.transformers import HFConnector
from tests.integrations.oracle import CHUNK, make_engine, reference, tiny_model, tokens
from tests.redis_servers import RedisServer

NEW = 10
MODELS = [("llama", torch.float32, 1e-5), ("qwen2", torch.bfloat16, 6e-2)]
IDS = ["llama-float32", "qwen2-bfloat16"]


def warm_then_serve(model: Any, tol: float, tier: str, **overrides: object) -> None:
    """Engine 1 computes and stores; engine 2 (a new process's view: empty CPU tier) must
    serve the prefix from ``tier`` and generate exactly what recomputation generates."""
    base = tokens(4 * CHUNK + 5, seed=21)
    first = make_engine(model, **overrides)
    try:
        HFConnector(first, model).generate(base, 2)
        assert first.flush(10)
    finally:
        first.close()  # drains writes: the data is in the lower tier, the CPU copy is gone

    second = make_engine(model, **overrides)
    try:
        conn = HFConnector(second, model)
        prompt = torch.cat([base, tokens(11, seed=22)])
        want_tokens, want_logits = reference(model, prompt, NEW)
        pre = conn.prefill(prompt)
        assert pre.reused_tokens == 4 * CHUNK
        assert second.stats()["hit_tokens_by_tier"] == {tier: 4 * CHUNK}
        torch.testing.assert_close(pre.logits.float(), want_logits.float(), atol=tol, rtol=0)
        assert conn.generate(prompt, NEW).tokens == want_tokens
        assert second.leaks() == []
        second.flush(10)
        assert second.check_invariants() == []
    finally:
        second.close()


@pytest.mark.parametrize(("family", "dtype", "tol"), MODELS, ids=IDS)
def test_disk_tier_after_restart(
    tmp_path: Path, family: str, dtype: torch.dtype, tol: float
) -> None:
    warm_then_serve(
        tiny_model(family, dtype),
        tol,
        "disk",
        local_disk=str(tmp_path),
        max_local_disk_size="64MiB",
    )


@pytest.mark.parametrize(("family", "dtype", "tol"), MODELS, ids=IDS)
def test_redis_tier_shared_by_two_engines(
    redis_server: RedisServer, family: str, dtype: torch.dtype, tol: float
) -> None:
    redis_server.client().flushall()
    warm_then_serve(tiny_model(family, dtype), tol, "redis", remote_url=redis_server.url)


def test_corrupt_chunk_on_disk_is_recomputed_not_served(tmp_path: Path) -> None:
    """A chunk whose bytes rotted on disk ends the hit there; the rest is recomputed and the
    output is still exactly the reference."""
    model = tiny_model("llama", torch.float32)
    overrides = {"local_disk": str(tmp_path), "max_local_disk_size": "64MiB"}
    base = tokens(4 * CHUNK + 5, seed=23)
    first = make_engine(model, **overrides)
    try:
        HFConnector(first, model).generate(base, 2)
        spans = first.keychain.keys(base, include_partial=False)
        name = f"{first.fingerprint.hex()}-{spans[2].key.hex()}.kvc"
    finally:
        first.close()
    with open(tmp_path / name, "r+b") as f:  # flip one payload byte near the end of the record
        f.seek(-100, 2)
        byte = f.read(1)
        f.seek(-100, 2)
        f.write(bytes([byte[0] ^ 0xFF]))

    second = make_engine(model, **overrides)
    try:
        conn = HFConnector(second, model)
        want_tokens, want_logits = reference(model, base, NEW)
        pre = conn.prefill(base)
        assert pre.loaded_tokens == 2 * CHUNK and pre.reused_tokens == 2 * CHUNK
        torch.testing.assert_close(pre.logits, want_logits, atol=1e-5, rtol=0)
        assert conn.generate(base, NEW).tokens == want_tokens
        assert second.leaks() == []
    finally:
        second.close()
