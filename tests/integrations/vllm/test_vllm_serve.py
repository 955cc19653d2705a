"""vLLM's OpenAI server with the connector: a completion over HTTP, and a second request with
the same prefix loaded from kvtier."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.integrations.vllm.channel import LookupClient
from kvtier.integrations.vllm.checkpoint import words_for
from tests.redis_servers import free_port

from .serve_helpers import Server, complete, post
from .vllm_helpers import CONNECTOR, Instances, tokens

pytestmark = pytest.mark.slow

ENGINE_ID = "kvtier-test-serve"


@pytest.fixture(scope="module")
def server(
    model_dir: Path, instances: Instances, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    instances.close()  # one vLLM at a time
    transfer = {
        **CONNECTOR,
        "engine_id": ENGINE_ID,
        "kv_connector_extra_config": {"max_local_cpu_size": "64MiB"},
    }
    log = tmp_path_factory.mktemp("serve") / "vllm-serve.log"
    # Dev mode adds POST /reset_prefix_cache, so the second request cannot use vLLM's own.
    srv = Server(model_dir, free_port(), transfer, log, VLLM_SERVER_DEV_MODE="1")
    try:
        srv.wait_ready()
        yield srv.url
    finally:
        srv.stop()


def test_openai_completion_and_a_prefix_hit(server: str) -> None:
    probe = LookupClient(ENGINE_ID)
    try:
        shared = tokens(600, seed=50)
        first = complete(server, words_for(shared + tokens(40, seed=51)))
        assert len(first["choices"][0]["text"].split()) == 4
        assert first["usage"]["prompt_tokens"] == 640
        before = probe.call("stats")
        assert before["hit_tokens"] == 0 and before["stored_chunks"] == 2

        assert post(f"{server}/reset_prefix_cache")["success"] is True
        second = complete(server, words_for(shared + tokens(70, seed=52)))
        assert second["usage"]["prompt_tokens"] == 670
        after = probe.call("stats")
        assert after["hit_tokens"] - before["hit_tokens"] == 512
        assert after["retrieved_tokens"] - before["retrieved_tokens"] == 512
        assert probe.call("leaks") == [] and probe.call("check") == []
        # kvtier's counters reach vLLM's own /metrics (through vLLM's connector stats).
        assert metric(server, "vllm:kvtier_hit_tokens_total") == 512
        assert metric(server, "vllm:kvtier_retrieved_tokens_total") == 512
        assert metric(server, "vllm:kvtier_stored_chunks_total") == 2
    finally:
        probe.close()


def metric(url: str, name: str, timeout: float = 15.0) -> float:
    """The value of ``name`` on /metrics (summed over labels), once it is reported: vLLM
    hands stats to its API process asynchronously."""
    deadline = time.monotonic() + timeout
    value = 0.0
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
            text = response.read().decode()
        value = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(name + "{") or line.startswith(name + " ")
        )
        if value:
            return value
        time.sleep(0.5)
    return value
