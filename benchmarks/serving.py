"""The processes ``python -m benchmarks serve`` starts, and the counters it reads from them.

    VLLMServer    ``python -m vllm.entrypoints.openai.api_server`` in its own process group
                  (stopping the group stops its engine core and workers too)
    KVTierServer  ``kvtier server`` on a Unix socket, for the ``server`` configuration
    counters()    what served a pass: vLLM's own /metrics (prompt tokens, its prefix cache's
                  hits, the connector's hits) and, for kvtier, the worker's Engine stats over
                  its lookup channel (tokens loaded, by tier; through a kvtier server, the
                  server's Engine for this model)

A pass's figure only means what the table says if its counters agree: the bench records them
per pass and names every disagreement (see ``benchmarks.serve_figures.problems``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvtier.server.spawn import spawn_server

SERVED_NAME = "kvtier-bench"
START_TIMEOUT_S = 900.0  # a 24-layer model on a loaded 2-core machine starts slowly
METRICS = {
    "prompt_tokens": "vllm:prompt_tokens_total",
    "vllm_cached_tokens": "vllm:prefix_cache_hits_total",
    "connector_tokens": "vllm:external_prefix_cache_hits_total",
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class VLLMServer:
    """vLLM's OpenAI API server for ``model``, started and healthy on return; ``kvtier``: its
    connector is kvtier's (whose Engine :meth:`flush` and :meth:`counters` reach)."""

    def __init__(
        self,
        name: str,
        model: Path,
        options: list[str],
        transfer: dict[str, Any] | None,
        env: dict[str, str],
        work: Path,
        *,
        kvtier: bool,
    ) -> None:
        port = free_port()
        engine_id = f"bench-serve-{name}-{port}"
        self.engine_id = engine_id if kvtier else None  # kvtier's channel is named after it
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model),
            "--served-model-name", SERVED_NAME,
            "--host", "127.0.0.1",
            "--port", str(port),
            *options,
        ]  # fmt: skip
        if transfer is not None:
            cmd += ["--kv-transfer-config", json.dumps({**transfer, "engine_id": engine_id})]
        self.url = f"http://127.0.0.1:{port}"
        self.log = work / f"vllm-{name}-{port}.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while not healthy(self.url):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = self.log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"vLLM ({name}) did not come up; log:\n{tail}")
            time.sleep(1)

    def warm_up(self, tokens: int = 200) -> None:
        """One short request whose prompt is shorter than a kvtier chunk (nothing stored, nothing
        to hit), so a fresh server's first measured request does not pay its one-time costs."""
        body = {
            "model": SERVED_NAME,
            "prompt": [7] * tokens,
            "max_tokens": 2,
            "temperature": 0,
        }
        request = urllib.request.Request(
            f"{self.url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=600) as response:
            response.read()

    def flush(self) -> None:
        """Wait until kvtier's lower tiers hold everything stored so far (a no-op without
        kvtier), so a fresh server finds it and no write shares the cores with a measurement."""
        if self.engine_id is None:
            return
        from kvtier.integrations.vllm.rpc import LookupClient

        client = LookupClient(self.engine_id)
        try:
            client.flush(120.0, timeout=180.0)
        finally:
            client.close()

    def counters(self) -> dict[str, Any]:
        """vLLM's cache counters and, with kvtier, its Engine's (see the module docstring)."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as response:
            out: dict[str, Any] = parse_metrics(response.read().decode())
        if self.engine_id is not None:
            from kvtier.integrations.vllm.rpc import LookupClient

            client = LookupClient(self.engine_id)
            try:
                stats: dict[str, Any] = client.stats(timeout=30.0)
            finally:
                client.close()
            out["kvtier_tokens"] = int(stats.get("retrieved_tokens", 0))
            out["kvtier_tokens_by_tier"] = dict(stats.get("hit_tokens_by_tier", {}))
        return out

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def parse_metrics(text: str) -> dict[str, int]:
    """:data:`METRICS` from Prometheus text, each summed over its label sets."""
    out = dict.fromkeys(METRICS, 0)
    names = {metric: key for key, metric in METRICS.items()}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        key = names.get(line.split("{", 1)[0].split(" ", 1)[0])
        if key is not None:
            out[key] += int(float(line.rsplit(" ", 1)[1]))
    return out


def counter_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What a pass added to each counter (by-tier counts as a dict of increases)."""
    out: dict[str, Any] = {}
    for key, value in after.items():
        if isinstance(value, dict):
            old = before.get(key, {})
            grown = {t: n - old.get(t, 0) for t, n in value.items() if n - old.get(t, 0)}
            out[key] = grown
        else:
            out[key] = value - before.get(key, 0)
    return out


class KVTierServer:
    """``kvtier server`` on a Unix socket (CPU tier of ``cpu_size``), started on return."""

    def __init__(self, sock: str, cpu_size: str, work: Path, chunk_size: int | None = None) -> None:
        env = {**os.environ, "KVTIER_MAX_LOCAL_CPU_SIZE": cpu_size}
        if chunk_size is not None:
            env["KVTIER_CHUNK_SIZE"] = str(chunk_size)
        self.log = work / "kvtier-server.log"
        with self.log.open("wb") as out:
            # A child that dies with the bench: one killed by a timeout leaves no server.
            self.proc = spawn_server(
                sock, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + 120
        while not os.path.exists(sock):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"kvtier server did not start; see {self.log}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False
