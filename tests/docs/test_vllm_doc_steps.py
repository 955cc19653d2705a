"""docs/vllm.md's first steps as a newcomer takes them: how to reach `kvtier` from a clone,
the config checked before vLLM starts, and the curl requests of "Verify that it works", run
with bash as written (against a stand-in HTTP server here; the real vLLM runs them in
tests/integrations/vllm/test_vllm_doc_command.py's way)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

from kvtier.demo.checkpoint import TinyLlama

from .doc_blocks import block_after, section
from .test_vllm_doc import TINY

DOC = "docs/vllm.md"
VENV_BIN = str(Path(sys.executable).parent)  # `kvtier` and `python` as after `source .venv/...`


def _bash(script: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ['PATH']}"}
    return subprocess.run(
        ["bash", "-c", "set -e\n" + script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env=env,
    )


def test_install_says_how_to_reach_kvtier_after_make() -> None:
    text = " ".join(section(DOC, "## Install").split())
    assert "`source .venv/bin/activate`" in text and "`.venv/bin/kvtier`" in text


def _check_block() -> str:
    return block_after(DOC, "### Check the config first", "bash")


def test_the_checked_config_is_the_cpu_blocks() -> None:
    check = re.search(r"<<'EOF'\n(.*?)\nEOF\n", _check_block(), re.S)
    assert check, _check_block()
    cpu = block_after(DOC, "### CPU build", "bash")
    vllm = json.loads(re.search(r"--kv-transfer-config '([^']*)'", cpu)[1])  # type: ignore[index]
    assert json.loads(check[1]) == vllm["kv_connector_extra_config"]


def test_the_check_step_runs_and_names_a_typo(tmp_path: Path) -> None:
    script = (
        _check_block()
        .replace("/tmp/kvtier.json", str(tmp_path / "kvtier.json"))
        .replace("/var/cache/kvtier", str(tmp_path / "disk"))
    )
    ok = _bash(script, tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert "checked: local_disk: write+fsync+delete" in ok.stdout
    assert re.search(r"max_local_cpu_size\s+1073741824 \(1\.00 GiB\)\s+file ", ok.stdout)
    typo = _bash(script.replace('"max_local_disk_size"', '"max_local_disk_sise"'), tmp_path)
    assert typo.returncode == 2
    assert "did you mean 'max_local_disk_size'?" in typo.stderr


class _Recorder(BaseHTTPRequestHandler):
    """Answers every POST with ``{}`` and keeps (path, body)."""

    seen: ClassVar[list[tuple[str, bytes]]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.seen.append((self.path, body))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def recorder() -> Iterator[tuple[int, list[tuple[str, bytes]]]]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    seen = _Recorder.seen
    seen.clear()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], seen
    finally:
        server.shutdown()
        server.server_close()


def test_the_verify_curls_send_a_1408_token_prompt_of_the_tiny_vocabulary(
    recorder: tuple[int, list[tuple[str, bytes]]], tmp_path: Path
) -> None:
    port, seen = recorder
    text = (Path(__file__).parents[2] / DOC).read_text()
    verify = text[text.index("## Verify that it works") : text.index("## Stopping vLLM")]
    steps = [
        block_after(DOC, "2. Send a prompt longer than one chunk", "bash"),
        block_after(DOC, "The chat endpoint takes the same prompt", "bash"),
        re.search(r"`(curl -s -X POST localhost:8000/reset_prefix_cache)`", verify)[1],  # type: ignore[index]
    ]
    result = _bash("\n".join(steps).replace("localhost:8000", f"127.0.0.1:{port}"), tmp_path)
    assert result.returncode == 0, result.stderr
    paths = [path for path, _ in seen]
    assert paths == ["/v1/completions", "/v1/chat/completions", "/reset_prefix_cache"]
    completion, chat = (json.loads(body) for _, body in seen[:2])
    assert completion["model"] == chat["model"] == TINY
    words = completion["prompt"].split()
    assert len(words) == 1408 and completion["max_tokens"] == 2
    vocabulary = {f"w{i}" for i in range(TinyLlama().vocab - 3)}  # the tokenizer's words
    assert set(words) <= vocabulary
    assert chat["messages"] == [{"role": "user", "content": completion["prompt"]}]
