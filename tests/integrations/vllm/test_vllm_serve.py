"""``vllm serve`` with the connector: an OpenAI completion over HTTP, and a second request
with the same prefix served from kvtier."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.integrations.vllm.channel import LookupClient
from kvtier.integrations.vllm.checkpoint import words_for
from tests.redis_servers import free_port

from .vllm_helpers import CONNECTOR, Instances, tokens

pytestmark = pytest.mark.slow

ENGINE_ID = "kvtier-test-serve"
START_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def server(
    model_dir: Path, instances: Instances, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    instances.close()  # one vLLM at a time
    port = free_port()
    transfer = {
        **CONNECTOR,
        "engine_id": ENGINE_ID,
        "kv_connector_extra_config": {"max_local_cpu_size": "64MiB"},
    }
    log = tmp_path_factory.mktemp("serve") / "vllm-serve.log"
    cmd = [
        str(Path(sys.executable).with_name("vllm")),
        "serve",
        str(model_dir),
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--enforce-eager",
        "--dtype",
        "float32",
        "--max-model-len",
        "4096",
        "--served-model-name",
        "tiny",
        "--kv-transfer-config",
        json.dumps(transfer),
    ]
    # Dev mode adds POST /reset_prefix_cache, so the second request cannot use vLLM's own.
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1"}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vllm serve did not come up; log:\n{log.read_text()[-4000:]}")
            time.sleep(1)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # vLLM shuts its engine down on SIGINT
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def _post(url: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    data = json.dumps(body or {}).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return dict(json.loads(response.read()))


def _complete(url: str, prompt: str) -> dict[str, Any]:
    body = json.dumps(
        {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}
    ).encode()
    request = urllib.request.Request(
        f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return dict(json.loads(response.read()))


def test_openai_completion_and_a_prefix_hit(server: str) -> None:
    probe = LookupClient(ENGINE_ID)
    try:
        shared = tokens(600, seed=50)
        first = _complete(server, words_for(shared + tokens(40, seed=51)))
        assert first["choices"][0]["text"].strip()
        assert first["usage"]["prompt_tokens"] == 640
        before = probe.call("stats")
        assert before["hit_tokens"] == 0 and before["stored_chunks"] == 2

        assert _post(f"{server}/reset_prefix_cache")["success"] is True
        second = _complete(server, words_for(shared + tokens(70, seed=52)))
        assert second["usage"]["prompt_tokens"] == 670
        after = probe.call("stats")
        assert after["hit_tokens"] - before["hit_tokens"] == 512
        assert after["retrieved_tokens"] - before["retrieved_tokens"] == 512
        assert probe.call("leaks") == [] and probe.call("check") == []
    finally:
        probe.close()
