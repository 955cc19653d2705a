"""vLLM's OpenAI server with the connector, and disaggregated prefill behind kvtier pd-proxy.

One pair of servers serves both tests (start-up is the slow part): the prefiller is a
kv_both instance (a prefix cache in its own right, and a PD sender), the decoder a
kv_consumer (PD receiver). The first test talks to the prefiller alone; the second goes
through the proxy, and the prefiller's KV travels over kvtier's PD transport (tcp).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvtier.cli.pd_proxy import make_server
from kvtier.integrations.vllm.rpc import LookupClient
from kvtier.testing.checkpoint import words_for
from tests.docs.doc_blocks import block_after
from tests.redis_servers import free_port

from .conftest import PROMPTS
from .serve_helpers import Server, complete, post
from .vllm_helpers import CONNECTOR, MAX_TOKENS, Instances, tokens, unique_engine_id

pytestmark = pytest.mark.slow

PREFILLER = unique_engine_id("kvtier-test-prefiller")
DECODER = unique_engine_id("kvtier-test-decoder")


@dataclass
class Servers:
    prefiller: str
    decoder: str
    proxy: str
    kill_prefiller: Callable[[], None]


@pytest.fixture(scope="module")
def servers(
    model_dir: Path, instances: Instances, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Servers]:
    instances.close()  # the in-process vLLMs are done with; these two need to run together
    logs = tmp_path_factory.mktemp("http")
    pd_port = free_port()
    decoder = Server(
        model_dir,
        free_port(),
        documented("The decoder's", DECODER, pd_port, pd_buffer_size="16MiB"),
        logs / "decoder.log",
    )
    # Dev mode adds POST /reset_prefix_cache, so a request cannot use vLLM's own cache.
    prefiller = Server(
        model_dir,
        free_port(),
        documented("The prefiller's", PREFILLER, pd_port),
        logs / "prefiller.log",
        VLLM_SERVER_DEV_MODE="1",
    )
    proxy = make_server(prefiller.url, decoder.url)
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    try:
        decoder.wait_ready()
        prefiller.wait_ready()
        thread.start()
        proxy_url = f"http://127.0.0.1:{proxy.server_port}"
        yield Servers(prefiller.url, decoder.url, proxy_url, prefiller.kill)
    finally:
        proxy.shutdown()
        proxy.server_close()
        prefiller.stop()
        decoder.stop()


def documented(side: str, engine_id: str, pd_port: int, **sizes: str) -> dict[str, Any]:
    """The --kv-transfer-config JSON docs/vllm.md gives for one side, with this test's
    engine id, PD port and sizes (scaled down for the tiny model); the rest as written."""
    config = json.loads(block_after("docs/vllm.md", side, "json"))
    assert {k: v for k, v in config.items() if k in CONNECTOR} == CONNECTOR | {
        "kv_role": config["kv_role"]
    }
    extra = config["kv_connector_extra_config"]
    for key in ("pd_peer_alloc_port", "max_local_cpu_size", *sizes):
        assert key in extra, f"docs/vllm.md's {side} config has no {key}"
    extra.update(pd_peer_alloc_port=[pd_port], max_local_cpu_size="64MiB", **sizes)
    return {**config, "engine_id": engine_id}


def test_the_documented_pd_roles() -> None:
    decoder = json.loads(block_after("docs/vllm.md", "The decoder's", "json"))
    prefiller = json.loads(block_after("docs/vllm.md", "The prefiller's", "json"))
    assert decoder["kv_role"] == "kv_consumer" and prefiller["kv_role"] == "kv_both"
    assert decoder["kv_connector_extra_config"]["pd_role"] == "receiver"
    assert prefiller["kv_connector_extra_config"]["pd_role"] == "sender"


def test_openai_completion_then_a_prefix_hit_and_metrics(servers: Servers) -> None:
    url = servers.prefiller
    probe = LookupClient(PREFILLER)
    try:
        shared = tokens(600, seed=50)
        first = complete(url, words_for(shared + tokens(40, seed=51)))
        assert len(first["choices"][0]["text"].split()) == 4
        assert first["usage"]["prompt_tokens"] == 640
        before = probe.call("stats")
        assert before["hit_tokens"] == 0 and before["stored_chunks"] == 2

        assert post(f"{url}/reset_prefix_cache")["success"] is True
        second = complete(url, words_for(shared + tokens(70, seed=52)))
        assert second["usage"]["prompt_tokens"] == 670
        after = probe.call("stats")
        assert after["hit_tokens"] - before["hit_tokens"] == 512
        assert after["retrieved_tokens"] - before["retrieved_tokens"] == 512
        assert probe.call("leaks") == [] and probe.call("check") == []
        # kvtier's counters reach vLLM's own /metrics (through vLLM's connector stats).
        assert metric(url, "vllm:kvtier_hit_tokens_total") == 512
        assert metric(url, "vllm:kvtier_retrieved_tokens_total") == 512
        assert metric(url, "vllm:kvtier_stored_chunks_total") == 2
    finally:
        probe.close()


def test_disaggregated_prefill_gives_the_single_instance_tokens(
    servers: Servers, reference: dict[str, list[list[int]]]
) -> None:
    decoder = LookupClient(DECODER)
    try:
        for name in ("a", "d"):
            answer = complete(servers.proxy, words_for(PROMPTS[name]), max_tokens=MAX_TOKENS)
            words = [f"w{t - 3}" for t in reference[name][0] if t >= 3]  # specials print nothing
            assert answer["choices"][0]["text"].split() == words
        stats = decoder.call("stats")
        # a: 3 whole chunks, d: 2, all received from the prefiller (the decoder never saves)
        assert stats["hit_tokens_by_tier"].get("pd") == 768 + 512
        assert stats["retrieved_tokens"] == 768 + 512
        assert stats["stored_chunks"] == 0
        assert decoder.call("leaks") == [] and decoder.call("check") == []
        # Both leases ended (the request's and the transfer's): the buffer is free again.
        assert stats["tiers"]["pd"]["used_bytes"] == 0
    finally:
        decoder.close()


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


def test_a_prefiller_killed_mid_request_leaves_the_decoder_prefilling(
    servers: Servers, reference: dict[str, list[list[int]]]
) -> None:
    """Last in this module: it kills the prefiller 0.15 s into a 3,900-token prompt, while it
    prefills (chunk by chunk) and sends what it has. Whatever arrived, the proxy's request
    gets the single-instance answer from the decoder, which prefills the rest itself, and the
    decoder is left holding nothing: no lease, no reserved buffer page."""
    answers: list[dict[str, Any]] = []
    client = threading.Thread(
        target=lambda: answers.append(
            complete(servers.proxy, words_for(PROMPTS["long"]), max_tokens=MAX_TOKENS)
        )
    )
    client.start()
    time.sleep(0.15)
    servers.kill_prefiller()
    client.join(timeout=300)
    words = [f"w{t - 3}" for t in reference["long"][0] if t >= 3]
    assert len(answers) == 1 and answers[0]["choices"][0]["text"].split() == words
    decoder = LookupClient(DECODER)
    try:
        deadline = time.monotonic() + 10
        while decoder.call("leaks") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert decoder.call("leaks") == [] and decoder.call("check") == []
        assert decoder.call("stats")["tiers"]["pd"]["used_bytes"] == 0
    finally:
        decoder.close()
