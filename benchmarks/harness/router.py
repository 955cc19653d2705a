"""A fleet on loopback for the tests and ``python -m benchmarks fleet``: vLLM OpenAI servers that
publish KV events (:mod:`benchmarks.harness.vllm_server`), and vllm-router in front of them.
Real processes, each in its own process group, so stopping one stops what it spawned.

::

    client ──HTTP──▶ vllm-router (--policy kv_aware) ──HTTP──▶ vLLM "a" (core 0) ─┐ kvtier
                          ▲  ▲                         ──HTTP──▶ vLLM "b" (core 1) ─┤ CPU tier each,
                          │  └── ZMQ SUB  tcp://…:pub_b  ◀── KV events ─────────────┤ one Redis
                          └───── ZMQ SUB  tcp://…:pub_a  (DEALER replay: …:replay_a)

Each vLLM's KV events go to ``tcp://127.0.0.1:<pub>`` with a replay buffer on ``<replay>``;
:func:`router_command` is the exact router command line the docs show.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.harness.vllm_server import SERVED_NAME, VllmServer, free_port, get, post, stop_group

BLOCK = 128  # vLLM's block size on the CPU build: the router's --kv-event-block-size


def router_binary() -> str:
    """``vllm-router`` beside this Python (the venv's), else on PATH."""
    here = Path(sys.executable).with_name("vllm-router")
    found = str(here) if here.exists() else shutil.which("vllm-router")
    if found is None:
        raise RuntimeError("vllm-router is not installed: pip install 'kvtier[fleet]'")
    return found


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
            get(f"{self.url}/v1/models")
        except urllib.error.HTTPError:
            return True  # it answers
        except OSError:
            return False
        return True

    def stop(self) -> None:
        stop_group(self.proc, signal.SIGTERM, 20)


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
        listed = json.loads(get(f"{self.url}/workers"))["workers"]
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
