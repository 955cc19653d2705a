"""vLLM's OpenAI server with the connector, and disaggregated prefill behind vllm-router.

One fleet serves every test (start-up is the slow part): two prefillers and two decoders, any
prefiller to any decoder (xPyD) behind one vllm-router in PD mode, unmodified (the command
docs/fleet.md gives), with vLLM's standard kv_transfer_params hand-off; the decoders pull each
request's KV from the prefiller the router chose over kvtier's PD transport (tcp). Prefiller 0
and decoder 0 run docs/fleet.md's xPyD configs; prefiller 1 and decoder 1 run LMCache's own 1p1d
example YAMLs (LMCACHE_CONFIG_FILE), sizes scaled down. The first test talks to prefiller 0
alone (a prefix cache in its own right); the last kills a prefiller and a decoder mid-run.
(The one-decoder push of 1P1D runs with vLLM's connector in test_pd_handoff.py.)
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from benchmarks.harness.pd import (
    documented_router,
    documented_transfer,
    settled_problems,
    stats_of,
)
from benchmarks.harness.router import RouterProcess

from kvtier.demo.checkpoint import words_for
from kvtier.integrations.vllm.rpc import LookupClient
from tests.config.test_lmcache_configs import DECODER as LMCACHE_DECODER
from tests.config.test_lmcache_configs import PREFILLER as LMCACHE_PREFILLER
from tests.docs.doc_blocks import block_after
from tests.redis_servers import free_port

from .conftest import PROMPTS, xpyd_prompts
from .serve_helpers import Server, complete, post
from .vllm_helpers import CONNECTOR, MAX_TOKENS, Instances, tokens, unique_engine_id

# The first test's setup computes the session's reference outputs (this module sorts first of
# those that need them), then starts the four servers: minutes on a loaded machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

PREFILLERS = [unique_engine_id(f"kvtier-test-prefiller-{i}") for i in range(2)]
DECODERS = [unique_engine_id(f"kvtier-test-decoder-{i}") for i in range(2)]
PREFILLER = PREFILLERS[0]
# Send buffers and receive reservations: short (the kill test waits it out), yet far beyond
# a request's trip from the prefiller's answer to its decoder's pull (well under a second).
TTL_S = 12.0
SCALED = {"max_local_cpu_size": "64MiB", "pd_buffer_size": "16MiB", "chunk_size": 256}


@dataclass
class Servers:
    prefillers: list[Server]
    decoders: list[Server]
    router: str

    @property
    def prefiller(self) -> str:
        return self.prefillers[0].url


@pytest.fixture(scope="module")
def servers(
    model_dir: Path,
    instances: Instances,
    reference: dict[str, list[list[int]]],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Servers]:
    # The reference first (an in-process vLLM), so that no more than these four run at once.
    instances.close()
    logs = tmp_path_factory.mktemp("http")
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    decoders = [
        Server(model_dir, free_port(), documented("xPyD decoder", DECODERS[0]), logs / "d0.log"),
        lmcache_server(model_dir, logs, "decoder", DECODERS[1], LMCACHE_DECODER),
    ]
    prefillers = [
        Server(
            model_dir,
            free_port(),
            documented("xPyD prefiller", PREFILLERS[0]),
            logs / "p0.log",
            # One chunk a step: a long prompt reaches the send buffer chunk by chunk.
            args=("--max-num-batched-tokens", "256"),
            # Dev mode adds POST /reset_prefix_cache, so a request cannot use vLLM's cache.
            VLLM_SERVER_DEV_MODE="1",
            **env,
        ),
        lmcache_server(model_dir, logs, "prefiller", PREFILLERS[1], LMCACHE_PREFILLER),
    ]
    router: RouterProcess | None = None
    try:
        for server in decoders + prefillers:
            server.wait_ready()
        port = free_port()
        command = documented_router([p.url for p in prefillers], [d.url for d in decoders], port)
        router = RouterProcess(command, port, logs / "router.log")
        router.wait_ready()
        yield Servers(prefillers, decoders, router.url)
    finally:
        if router is not None:
            router.stop()
        for server in prefillers + decoders:
            server.stop()


def documented(side: str, engine_id: str) -> dict[str, Any]:
    """The --kv-transfer-config JSON docs/fleet.md gives for one side, with this test's
    engine id, TTL and sizes (scaled down for the tiny model); the rest as written."""
    config = json.loads(block_after("docs/fleet.md", f"The {side}'s", "json"))
    assert {k: v for k, v in config.items() if k in CONNECTOR} == CONNECTOR | {
        "kv_role": config["kv_role"]
    }
    extra = config["kv_connector_extra_config"]
    for key in ("max_local_cpu_size", "pd_buffer_size"):
        assert key in extra, f"docs/fleet.md's {side} config has no {key}"
    assert "pd_peer_alloc_port" not in extra  # nothing names a peer in xPyD
    # The counts below are in 256-token chunks; the documented config leaves the chunk to
    # the connector (vLLM's block, 128 here), which tests/pd and test_groups.py cover.
    assert "chunk_size" not in extra
    return documented_transfer(side, engine_id, **SCALED, pd_reservation_ttl_sec=TTL_S)


def lmcache_server(
    model_dir: Path, logs: Path, role: str, engine_id: str, yaml_text: str
) -> Server:
    """A vLLM with LMCache's 1p1d example config for ``role`` (LMCACHE_CONFIG_FILE, as
    LMCache's example runs it: kv_producer / kv_consumer), its sizes and TTL scaled down in
    kv_connector_extra_config (LMCache's own override path) and its PD port a free one."""
    path = logs / f"lmcache-{role}.yaml"
    path.write_text(yaml_text)
    extra: dict[str, Any] = {**SCALED, "pd_reservation_ttl_sec": TTL_S}
    if role == "decoder":
        extra["pd_peer_alloc_port"] = [free_port()]  # the example's 7400 may be taken here
    transfer = {
        **CONNECTOR,
        "kv_role": "kv_producer" if role == "prefiller" else "kv_consumer",
        "engine_id": engine_id,
        "kv_connector_extra_config": extra,
    }
    return Server(
        model_dir,
        free_port(),
        transfer,
        logs / f"lmcache-{role}.log",
        LMCACHE_CONFIG_FILE=str(path),
        VLLM_CPU_NUM_OF_RESERVED_CPU="1",
    )


def test_the_documented_pd_roles() -> None:
    decoder = json.loads(block_after("docs/fleet.md", "The decoder's", "json"))
    prefiller = json.loads(block_after("docs/fleet.md", "The prefiller's", "json"))
    assert decoder["kv_role"] == "kv_consumer" and prefiller["kv_role"] == "kv_both"
    assert decoder["kv_connector_extra_config"]["pd_role"] == "receiver"
    assert prefiller["kv_connector_extra_config"]["pd_role"] == "sender"
    # 1P1D: the prefiller names its decoder's port; xPyD: nobody names a peer.
    assert prefiller["kv_connector_extra_config"]["pd_peer_alloc_port"] == [5555]
    for side in ("xPyD decoder", "xPyD prefiller"):
        config = json.loads(block_after("docs/fleet.md", f"The {side}'s", "json"))
        assert "pd_peer_alloc_port" not in config["kv_connector_extra_config"]


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


def words(reference_tokens: list[int]) -> list[str]:
    return [f"w{t - 3}" for t in reference_tokens if t >= 3]  # specials print nothing


def test_any_prefiller_to_any_decoder_gives_the_single_instance_tokens(
    servers: Servers, reference: dict[str, list[list[int]]]
) -> None:
    """16 requests over 4 shared prefixes, 4 at a time: each answer is vLLM's alone; each
    decoder loaded exactly what it pulled, and pulled each transfer from the prefiller that
    named it (the one the router chose); every buffer is free afterwards."""
    prompts = xpyd_prompts()
    answers: dict[int, dict[str, Any]] = {}

    def ask(i: int) -> None:
        answers[i] = complete(servers.router, words_for(prompts[i]), max_tokens=MAX_TOKENS)

    for first in range(0, len(prompts), 4):
        batch = [threading.Thread(target=ask, args=(i,)) for i in range(first, first + 4)]
        for thread in batch:
            thread.start()
        for thread in batch:
            thread.join(timeout=300)
    assert sorted(answers) == list(range(16))
    for i, expected in enumerate(reference["xpyd"]):
        assert answers[i]["choices"][0]["text"].split() == words(expected), i
    chunks = sum(a["usage"]["prompt_tokens"] // 256 for a in answers.values())
    assert chunks == 32  # 2 whole chunks each

    address = {}  # prefiller engine id -> its PD address
    for engine_id in PREFILLERS:
        source = stats_of(engine_id)["pd_source"]
        address[engine_id] = f"{source['host']}:{source['port']}"
    served: dict[str, int] = dict.fromkeys(PREFILLERS, 0)
    pulled_chunks = 0
    for engine_id in DECODERS:
        stats = stats_of(engine_id)
        recent = stats["pd_pulls"]["recent"]
        assert recent, f"decoder {engine_id} pulled nothing"
        for transfer_id, pulled_from, count, ok in recent:
            [named_by] = [p for p in PREFILLERS if transfer_id.startswith(p[:64] + "-")]
            why = (transfer_id, pulled_from, [stats_of(p)["pd_source"] for p in PREFILLERS])
            assert ok and pulled_from == address[named_by], why
            served[named_by] += 1
            pulled_chunks += count
        # Every request it decoded computed none of its 2 whole chunks: kvtier loaded them
        # (pulled; or, for a prefix pulled before, the copy its CPU tier kept) or vLLM's own
        # prefix cache had them; it never saves.
        url = servers.decoders[DECODERS.index(engine_id)].url

        def not_computed(url: str = url) -> int:  # reported to /metrics asynchronously
            by_source = prompt_tokens(url)
            return by_source["external_kv_transfer"] + by_source["local_cache_hit"]

        want = 512 * len(recent)
        assert wait_until(lambda w=want: not_computed() == w, 15), prompt_tokens(url)
        assert prompt_tokens(url)["external_kv_transfer"] > 0
        assert set(stats["hit_tokens_by_tier"]) <= {"pd", "cpu"}
        assert stats["stored_chunks"] == 0
    assert pulled_chunks == chunks and sum(served.values()) == 16
    assert all(served.values()), served  # both prefillers served (round robin: 8 each)
    for engine_id in PREFILLERS:  # each transfer was claimed once, and freed
        source = stats_of(engine_id)["pd_source"]
        assert source["served"] == served[engine_id] and source["refused_claims"] == 0
    assert_clean(wait_s=5)

    # Streamed: the router streams the decoder's answer; the same tokens, the same end.
    assert streamed(servers.router, words_for(PROMPTS["e"])).split() == words(reference["e"][0])
    assert_clean(wait_s=5)


def prompt_tokens(url: str) -> dict[str, int]:
    """vLLM's prompt tokens by source so far (/metrics): ``local_compute`` (prefilled),
    ``local_cache_hit`` (its own prefix cache), ``external_kv_transfer`` (kvtier)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    out = dict.fromkeys(("local_compute", "local_cache_hit", "external_kv_transfer"), 0)
    for match in re.finditer(
        r'^vllm:prompt_tokens_by_source_total\{[^}]*source="(\w+)"[^}]*\} ([0-9.e+]+)$',
        text,
        re.MULTILINE,
    ):
        out[match.group(1)] = out.get(match.group(1), 0) + int(float(match.group(2)))
    return out


def assert_clean(wait_s: float, engines: tuple[str, ...] = (*PREFILLERS, *DECODERS)) -> None:
    """Nothing pinned, leaked or held anywhere (within ``wait_s``: a prefiller frees a
    transfer right after its decoder's last byte; a TTL may have to run out)."""
    assert settled_problems(engines, wait_s) == []


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


def test_a_prefiller_and_a_decoder_killed_mid_run_leave_nothing_held_and_no_request_hung(
    servers: Servers, reference: dict[str, list[list[int]]]
) -> None:
    """Last in this module. 12 requests at once through the router; prefiller 0 is killed once
    a first answer is back, decoder 0 two answers later. Every client
    call returns (an answer, which must be vLLM's, or the router's error: it does not retry a
    dead prefill on another worker); then the survivors hold nothing (the TTL frees what the
    dead decoder never pulled) and still serve exact answers through the router."""
    prompts = xpyd_prompts()[:8] + [PROMPTS["long"]] * 4
    expected = reference["xpyd"][:8] + [reference["long"][0]] * 4
    results: dict[int, Any] = {}

    def ask(i: int) -> None:
        try:
            results[i] = complete(servers.router, words_for(prompts[i]), max_tokens=MAX_TOKENS)
        except (urllib.error.URLError, OSError) as exc:
            results[i] = exc

    threads = [threading.Thread(target=ask, args=(i,), daemon=True) for i in range(12)]
    started = time.monotonic()
    for thread in threads:
        thread.start()

    # Mid-run: once a first answer is back the others are in flight (the long prompts'
    # prefills take 16 steps of 256 tokens on prefiller 0); a decoder dies two answers later.
    assert wait_until(lambda: len(results) >= 1, 300), "no request came back"
    servers.prefillers[0].kill()
    assert len(results) < len(threads)  # the kill landed mid-run
    assert wait_until(lambda: len(results) >= 3, 120), f"{len(results)} of 12 came back"
    servers.decoders[0].kill()
    back_at_decoder_kill = len(results)
    # ... and so did the decoder's: requests were still out when it died (else this test
    # would only show that a dead decoder is skipped afterwards).
    assert back_at_decoder_kill < len(threads), "every request was back before decoder 0 died"
    for thread in threads:
        thread.join(timeout=max(1.0, 600 - (time.monotonic() - started)))
    assert not any(t.is_alive() for t in threads), "a request hung"
    answered = [i for i, r in results.items() if isinstance(r, dict)]
    for i in answered:
        assert results[i]["choices"][0]["text"].split() == words(expected[i]), i
    survivors = (PREFILLERS[1], DECODERS[1])
    assert_clean(wait_s=TTL_S + 20, engines=survivors)

    # The router no longer picks the dead (its health check): the survivors answer exactly.
    for i in (1, 2):
        answer = retried(lambda i=i: complete(servers.router, words_for(prompts[i]), MAX_TOKENS))
        assert answer["choices"][0]["text"].split() == words(expected[i])
    assert_clean(wait_s=5, engines=survivors)


def retried(call: Callable[[], dict[str, Any]], tries: int = 20) -> dict[str, Any]:
    """``call`` until it answers (while the router still routes to a dead worker)."""
    for _ in range(tries - 1):
        try:
            return call()
        except urllib.error.HTTPError:
            time.sleep(1.0)
    return call()


def wait_until(condition: Callable[[], bool], timeout_s: float) -> bool:
    """Poll ``condition`` every 20 ms for up to ``timeout_s``; whether it came true."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False
