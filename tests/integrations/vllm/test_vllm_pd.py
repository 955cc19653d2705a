"""Disaggregated prefill: a prefiller vLLM (kv_producer) and a decoder vLLM (kv_consumer)
behind ``kvtier pd-proxy``; the prefiller's KV travels over kvtier's PD transport (tcp)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.cli.pd_proxy import make_server
from kvtier.integrations.vllm.channel import LookupClient
from kvtier.integrations.vllm.checkpoint import words_for
from tests.redis_servers import free_port

from .conftest import PROMPTS
from .serve_helpers import Server, complete
from .vllm_helpers import CONNECTOR, MAX_TOKENS, Instances

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pd(
    model_dir: Path, instances: Instances, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """Both servers at once (a test that needs two), and the proxy in front."""
    instances.close()
    logs = tmp_path_factory.mktemp("pd")
    pd_port = free_port()
    common = {"max_local_cpu_size": "64MiB", "enable_pd": True, "pd_peer_alloc_port": [pd_port]}
    decoder = Server(
        model_dir,
        free_port(),
        transfer(
            "kv_consumer",
            "kvtier-test-decoder",
            {**common, "pd_role": "receiver", "pd_buffer_size": "16MiB"},
        ),
        logs / "decoder.log",
    )
    prefiller = Server(
        model_dir,
        free_port(),
        transfer("kv_producer", "kvtier-test-prefiller", {**common, "pd_role": "sender"}),
        logs / "prefiller.log",
    )
    proxy = make_server(prefiller.url, decoder.url)
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    try:
        decoder.wait_ready()
        prefiller.wait_ready()
        thread.start()
        yield f"http://127.0.0.1:{proxy.server_port}"
    finally:
        proxy.shutdown()
        proxy.server_close()
        prefiller.stop()
        decoder.stop()


def transfer(role: str, engine_id: str, extra: dict[str, Any]) -> dict[str, Any]:
    return {
        **CONNECTOR,
        "kv_role": role,
        "engine_id": engine_id,
        "kv_connector_extra_config": extra,
    }


def test_decoder_answers_from_the_prefillers_kv(
    pd: str, reference: dict[str, list[list[int]]]
) -> None:
    decoder = LookupClient("kvtier-test-decoder")
    try:
        for name in ("a", "d"):
            answer = complete(pd, words_for(PROMPTS[name]), max_tokens=MAX_TOKENS)
            words = [f"w{t - 3}" for t in reference[name][0] if t >= 3]  # specials print nothing
            assert answer["choices"][0]["text"].split() == words
        stats = decoder.call("stats")
        # a: 3 whole chunks, d: 2, all received from the prefiller (the decoder never saves)
        assert stats["hit_tokens_by_tier"].get("pd") == 768 + 512
        assert stats["retrieved_tokens"] == 768 + 512
        assert stats["stored_chunks"] == 0
        assert decoder.call("leaks") == [] and decoder.call("check") == []
        # Both leases ended (the request's and the transfer's): the buffer is free again.
        assert decoder.call("stats")["tiers"]["pd"]["used_bytes"] == 0
    finally:
        decoder.close()
