"""vLLM's OpenAI server with the connector, and disaggregated prefill behind vllm-router.

One pair of servers serves every test (start-up is the slow part): the prefiller is a
kv_both instance (a prefix cache in its own right, and a PD sender), the decoder a
kv_consumer (PD receiver). The first test talks to the prefiller alone; the others go
through vllm-router in PD mode, unmodified (the command docs/vllm.md gives), with vLLM's
standard kv_transfer_params hand-off; the prefiller's KV travels over kvtier's PD transport
(tcp).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from benchmarks.harness.router import RouterProcess, pd_command

from kvtier.demo.checkpoint import words_for
from kvtier.integrations.vllm.rpc import LookupClient
from tests.docs.doc_blocks import block_after
from tests.redis_servers import free_port

from .conftest import PROMPTS
from .serve_helpers import Server, complete, post
from .vllm_helpers import CONNECTOR, MAX_TOKENS, Instances, tokens, unique_engine_id

# The first test's setup computes the session's reference outputs (this module sorts first of
# those that need them), then starts both servers: minutes on a loaded machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PREFILLER = unique_engine_id("kvtier-test-prefiller")
DECODER = unique_engine_id("kvtier-test-decoder")
RESERVATION_TTL_S = 10.0  # short, yet far beyond a decode request's trip through the router


@dataclass
class Servers:
    prefiller: str
    decoder: str
    router: str
    kill_prefiller: Callable[[], None]


@pytest.fixture(scope="module")
def servers(
    model_dir: Path,
    instances: Instances,
    reference: dict[str, list[list[int]]],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Servers]:
    # The reference first (an in-process vLLM), so that no more than these two run at once.
    instances.close()  # the in-process vLLMs are done with; these two need to run together
    logs = tmp_path_factory.mktemp("http")
    pd_port = free_port()
    decoder_config = documented("The decoder's", DECODER, pd_port, pd_buffer_size="16MiB")
    # What a dead prefiller sent is freed this long after it arrived (120 s by default).
    decoder_config["kv_connector_extra_config"]["pd_reservation_ttl_sec"] = RESERVATION_TTL_S
    decoder = Server(model_dir, free_port(), decoder_config, logs / "decoder.log")
    # Dev mode adds POST /reset_prefix_cache, so a request cannot use vLLM's own cache.
    prefiller = Server(
        model_dir,
        free_port(),
        documented("The prefiller's", PREFILLER, pd_port),
        logs / "prefiller.log",
        # One chunk a step: a long prompt's chunks reach the decoder step by step, so the
        # kill test can land between the first chunk and the prefill's answer.
        args=("--max-num-batched-tokens", "256"),
        VLLM_SERVER_DEV_MODE="1",
    )
    router: RouterProcess | None = None
    try:
        decoder.wait_ready()
        prefiller.wait_ready()
        port = free_port()
        command = pd_command(prefiller.url, decoder.url, port, free_port())
        router = RouterProcess(command, port, logs / "router.log")
        router.wait_ready()
        yield Servers(prefiller.url, decoder.url, router.url, prefiller.kill)
    finally:
        if router is not None:
            router.stop()
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
    # The counts below are in 256-token chunks; the documented config leaves the chunk to
    # the connector (vLLM's block, 128 here), which tests/pd and test_groups.py cover.
    assert "chunk_size" not in extra
    extra["chunk_size"] = 256
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
        before = probe.stats()
        assert before["hit_tokens"] == 0 and before["stored_chunks"] == 2

        assert post(f"{url}/reset_prefix_cache")["success"] is True
        second = complete(url, words_for(shared + tokens(70, seed=52)))
        assert second["usage"]["prompt_tokens"] == 670
        after = probe.stats()
        assert after["hit_tokens"] - before["hit_tokens"] == 512
        assert after["retrieved_tokens"] - before["retrieved_tokens"] == 512
        assert probe.leaks() == [] and probe.check() == []
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
            answer = complete(servers.router, words_for(PROMPTS[name]), max_tokens=MAX_TOKENS)
            words = [f"w{t - 3}" for t in reference[name][0] if t >= 3]  # specials print nothing
            assert answer["choices"][0]["text"].split() == words
        stats = decoder.stats()
        # a: 3 whole chunks, d: 2, all received from the prefiller (the decoder never saves)
        assert stats["hit_tokens_by_tier"].get("pd") == 768 + 512
        assert stats["retrieved_tokens"] == 768 + 512
        assert stats["stored_chunks"] == 0
        assert decoder.leaks() == [] and decoder.check() == []
        # Both leases ended (the request's and the transfer's): the buffer is free again.
        assert stats["tiers"]["pd"]["used_bytes"] == 0
        # The same on vLLM's /metrics: the decoder loaded what the prefiller sent.
        assert metric(servers.decoder, "vllm:kvtier_retrieved_tokens_total") == 768 + 512

        # Streamed: the router streams the decoder's answer; the same tokens, the same end.
        words = [f"w{t - 3}" for t in reference["e"][0] if t >= 3]
        assert streamed(servers.router, words_for(PROMPTS["e"])).split() == words
        stats = decoder.stats()
        assert stats["hit_tokens_by_tier"]["pd"] == 768 + 512 + 512  # e: 2 whole chunks
        assert stats["tiers"]["pd"]["used_bytes"] == 0 and decoder.leaks() == []
    finally:
        decoder.close()


def streamed(url: str, prompt: str) -> str:
    """The text of a streamed completion (server-sent events), joined."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    body |= {"ignore_eos": True, "stream": True}
    request = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    text, events = "", 0
    with urllib.request.urlopen(request, timeout=120) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events += 1
            text += "".join(c.get("text", "") for c in json.loads(line[6:])["choices"])
    assert events > 1  # it came in pieces
    return text


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


def test_a_prefiller_killed_mid_request_leaves_the_decoder_holding_nothing(
    servers: Servers,
) -> None:
    """Last in this module: it kills the prefiller mid-transfer of a 3,900-token prompt: once
    the decoder's PD buffer holds the first chunks it sent, and before its prefill answered
    (the client's error says the decode request was never sent). vllm-router answers the
    client with an error (it does not fall back to the decoder when a prefill fails), and
    whatever arrived at the decoder is freed: no lease, no reserved buffer page once the
    reservation TTL has passed."""
    errors: list[int] = []

    def ask() -> None:
        try:
            complete(servers.router, words_for(PROMPTS["long"]), max_tokens=MAX_TOKENS)
        except urllib.error.HTTPError as exc:
            errors.append(exc.code)

    decoder = LookupClient(DECODER)
    try:

        def buffered() -> int:
            return int(decoder.stats()["tiers"]["pd"]["used_bytes"])

        assert wait_until(lambda: buffered() == 0, RESERVATION_TTL_S + 20)
        client = threading.Thread(target=ask, daemon=True)
        client.start()
        # Where the kill lands: after the first chunks reached the decoder (the transfer has
        # begun), before the prefill's answer (else the router would send the decode).
        assert wait_until(lambda: buffered() > 0, 120), "no chunk reached the decoder"
        servers.kill_prefiller()
        client.join(timeout=300)
        assert not client.is_alive()
        assert len(errors) == 1 and errors[0] >= 500
        deadline = time.monotonic() + RESERVATION_TTL_S + 20  # the TTL, then a watchdog tick
        while time.monotonic() < deadline and (decoder.leaks() or buffered()):
            time.sleep(0.2)
        assert decoder.leaks() == [] and decoder.check() == []
        assert decoder.stats()["tiers"]["pd"]["used_bytes"] == 0
    finally:
        decoder.close()


def wait_until(condition: Callable[[], bool], timeout_s: float) -> bool:
    """Poll ``condition`` every 20 ms for up to ``timeout_s``; whether it came true."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False
