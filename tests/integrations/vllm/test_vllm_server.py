"""Two vLLM instances on one ``kvtier server`` (``kv_connector_extra_config: {"server": ...}``).

The first instance stores its prompts in the server; it shuts down; a second, fresh vLLM
(its own prefix cache empty) hits what the first stored, from the server's CPU tier, and
its greedy outputs equal vLLM's with no connector. This is also the restart case: the cache
outlived the vLLM that filled it. The instances run one after the other (memory, CPU).
Afterwards the server holds no lease of either and its reference audit is clean.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.config import Config
from kvtier.demo.checkpoint import TinyLlama
from kvtier.errors import ConfigError, TransferError
from kvtier.integrations.vllm.sides import server_url
from kvtier.layout import KVLayout
from kvtier.server.client import ServerClient
from tests.server.server_helpers import (
    IDLE,
    ServerProcess,
    idle_server_state,
    wait_until,
)

from .conftest import PROMPTS
from .vllm_helpers import Instances, VllmInstance, unique_engine_id

pytestmark = pytest.mark.slow

CHUNK = 256
SHAPE = TinyLlama()
# What the worker's paged KV caches give (the checkpoint's shape, float32): the fingerprint
# a checking client needs to see the vLLM instances' model in the server.
LAYOUT = KVLayout(
    num_layers=SHAPE.num_layers,
    num_kv_heads=SHAPE.kv_heads,
    head_dim=SHAPE.head_dim,
    dtype=torch.float32,
)
FIRST = ["a", "d"]  # stored by the first instance
SECOND = ["a", "b", "d"]  # the second: all of a's and d's whole chunks, b's 2 shared with a
# Whole chunks the second instance must find in the server: a 1000 tokens -> 3 chunks,
# b shares a's first 2, d 700 tokens -> 2 chunks.
EXPECTED_HITS = 3 * CHUNK + 2 * CHUNK + 2 * CHUNK


def _instance(model_dir: Path, name: str, url: str) -> VllmInstance:
    return VllmInstance(
        model_dir, engine_id=unique_engine_id(f"kvtier-test-{name}"), extra={"server": url}
    )


def _checker(model_dir: Path, url: str) -> ServerClient:
    """A client with the vLLM worker's fingerprint (same model name, layout, chunk size)."""
    config = Config.load(overrides={"chunk_size": CHUNK}, env={})
    return ServerClient(url, LAYOUT, model_name=str(model_dir), config=config).open()


def test_second_vllm_hits_what_the_first_stored_in_the_server(
    model_dir: Path,
    instances: Instances,
    reference: dict[str, list[list[int]]],
    kvserver: ServerProcess,
) -> None:
    first = instances.get("server-1", lambda: _instance(model_dir, "server-1", kvserver.url))
    assert first.generate([PROMPTS[n] for n in FIRST]) == [reference[n][0] for n in FIRST]
    stored = first.stats()
    assert stored["connected"] and stored["stored_chunks"] == 3 + 2
    assert first.probe is not None and first.probe.check() == []
    instances.close()  # this vLLM is gone; what it stored stays in the server

    checker = _checker(model_dir, kvserver.url)
    try:
        assert idle_server_state(checker) == IDLE  # the first's leases ended with it
        before = checker.stats()
        assert before["tiers"]["cpu"]["entries"] == 3 + 2

        second = instances.get("server-2", lambda: _instance(model_dir, "server-2", kvserver.url))
        outs = second.generate([PROMPTS[n] for n in SECOND])
        assert outs == [reference[n][0] for n in SECOND]
        after = second.stats()
        hits = after["found_tokens"] - before["found_tokens"]
        assert hits == EXPECTED_HITS, (hits, after["lookup_tokens"] - before["lookup_tokens"])
        # The server has no lower tier: every hit was copied out of its CPU pages (a's and
        # d's chunks at least; b's shared two may come from vLLM's own prefix cache instead).
        assert set(after["tiers"]) == {"cpu"}
        retrieved = after["retrieved_tokens"] - before["retrieved_tokens"]
        assert retrieved >= 3 * CHUNK + 2 * CHUNK, retrieved
        # b (812 tokens) has one whole chunk of its own past the two it shares with a
        assert after["stored_chunks"] == before["stored_chunks"] + 1
        assert idle_server_state(checker) == IDLE  # every request ended while it runs
        assert second.probe is not None
        with pytest.raises(TransferError, match="kvtier server"):
            second.probe.clear()  # the server's admin API clears, not a vLLM worker
        instances.close()

        wait_until(lambda: checker.stats()["open_requests"] == 0, what="no lease left")
        assert idle_server_state(checker) == IDLE
        assert checker.stats()["tiers"]["cpu"]["entries"] == 3 + 2 + 1
    finally:
        checker.close()
    assert "Traceback" not in kvserver.log(), kvserver.log()


@pytest.mark.parametrize("value", ["/tmp/kvtier.sock", "unix://", 7, "tcp://127.0.0.1:1"], ids=str)
def test_server_key_must_be_a_unix_url(value: Any) -> None:
    with pytest.raises(ConfigError, match="server"):
        server_url({"server": value})
    assert server_url({}) is None
    assert server_url({"server": "unix:///tmp/x.sock"}) == "unix:///tmp/x.sock"
