"""The load path's accounting: a CPU hit served from the page its lookup pinned counts in the
CPU tier's own counters too (/stats tiers.cpu), not only in the engine's hit tokens."""

from __future__ import annotations

import torch

from kvtier import Engine
from tests.conftest import SMALL_CHUNK, SMALL_LAYOUT, make_kv, make_tokens, small_config


def test_a_cpu_hit_counts_in_the_cpu_tiers_hits_and_bytes() -> None:
    tokens, kv = make_tokens(4 * SMALL_CHUNK), make_kv(4 * SMALL_CHUNK)
    with Engine(small_config(), SMALL_LAYOUT, model_name="loads") as engine:
        assert engine.store(tokens, kv) == 4
        before = engine.stats()["tiers"]["cpu"]
        with engine.request("r"):
            assert engine.lookup(tokens, "r").tokens == 4 * SMALL_CHUNK
            assert torch.equal(engine.retrieve(tokens, "r"), kv)
        after = engine.stats()["tiers"]["cpu"]
    assert after["hits"] - before["hits"] == 4
    assert after["bytes_read"] - before["bytes_read"] == kv.numel() * kv.element_size()
