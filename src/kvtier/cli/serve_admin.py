"""``kvtier serve-admin``: an engine with its admin API and dashboard, fed by a small
synthetic chat workload so the page has something to show.

The workload (no model): sessions share a system prompt and grow turn by turn, so later turns
hit their earlier prefix; new sessions arrive now and then; some requests stay open for a few
steps so leases show up. Each request does what a connector does: lookup, retrieve, store the
rest, report a TTFT, end the request. The TTFT is *modelled* (``--prefill-us-per-token`` per
prefilled token), not measured: it only drives the dashboard's TTFT-saved panel.
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from collections import deque

import torch

from kvtier.config import Config
from kvtier.engine import Engine
from kvtier.errors import InputError
from kvtier.layout import KVLayout
from kvtier.service import Service

SYSTEM_PROMPT_TOKENS = 512
MAX_PROMPT_TOKENS = 4096


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", help="kvtier YAML (default: $KVTIER_CONFIG_FILE, else defaults)"
    )
    parser.add_argument("--host", default=None, help="bind address (default: config, 127.0.0.1)")
    parser.add_argument(
        "--port",
        type=int,
        default=None,
        help="first port to try; 0 picks a free one (default: config)",
    )
    parser.add_argument(
        "--token", default=None, help="bearer token (default: config / $KVTIER_ADMIN_TOKEN; none)"
    )
    parser.add_argument(
        "--cpu-size", default="64MiB", help="CPU cache size for the demo engine (64MiB)"
    )
    parser.add_argument(
        "--duration", type=float, default=0.0, help="seconds to run; 0 runs until Ctrl-C"
    )
    parser.add_argument("--rate", type=float, default=4.0, help="synthetic requests per second (4)")
    parser.add_argument(
        "--no-workload", action="store_true", help="serve only; no synthetic requests"
    )
    parser.add_argument(
        "--prefill-us-per-token",
        type=float,
        default=60.0,
        help="modelled prefill cost reported as TTFT (60 µs per token)",
    )
    parser.add_argument("--seed", type=int, default=0, help="workload random seed (0)")


def run(args: argparse.Namespace) -> int:
    if not args.rate > 0:
        raise InputError(
            f"--rate must be a positive number of requests per second, got {args.rate}"
        )
    if not args.duration >= 0:
        raise InputError(f"--duration must be seconds >= 0 (0 = until Ctrl-C), got {args.duration}")
    overrides: dict[str, object] = {
        "internal_api_server_enabled": True,
        "max_local_cpu_size": args.cpu_size,
    }
    if args.host is not None:
        overrides["internal_api_server_host"] = args.host
    if args.port is not None:
        overrides["internal_api_server_port_start"] = args.port
    if args.token is not None:
        overrides["admin_token"] = args.token
    config = Config.load(args.config, overrides=overrides)
    layout = KVLayout(num_layers=8, num_kv_heads=4, head_dim=64, dtype=torch.float16)
    stop = threading.Event()
    with Service(config, layout, model_name="kvtier-synthetic") as service:
        engine = service.engine
        if service.admin_url is None:
            print("kvtier: error: the admin server did not start (see the log)", file=sys.stderr)
            return 1
        hint = "?token=<token>" if config.admin_token else ""
        print(f"dashboard: {service.admin_url}/{hint}", flush=True)
        print(f"metrics:   {service.admin_url}/metrics", flush=True)
        deadline = time.monotonic() + args.duration if args.duration else None
        try:
            if args.no_workload:
                while deadline is None or time.monotonic() < deadline:
                    stop.wait(0.2)
            else:
                Workload(engine, args.seed, args.prefill_us_per_token / 1e6).run(
                    args.rate, deadline, stop
                )
        except KeyboardInterrupt:
            pass
    return 0


class Workload:
    """Multi-turn chat sessions over one engine; see the module docstring."""

    def __init__(self, engine: Engine, seed: int, prefill_s_per_token: float) -> None:
        self.engine = engine
        self.rng = random.Random(seed)
        self.prefill_s_per_token = prefill_s_per_token
        self.system = self._tokens(SYSTEM_PROMPT_TOKENS)
        self.sessions: list[list[int]] = []
        self.open: deque[tuple[str, int]] = deque()  # (request id, step to end it at)
        layout = engine.layout
        # One zero KV buffer, sliced per request: the content does not matter here.
        self.kv = torch.zeros(layout.kv_shape(MAX_PROMPT_TOKENS), dtype=layout.dtype)
        self.step = 0

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(32000) for _ in range(n)]

    def next_prompt(self) -> list[int]:
        if not self.sessions or self.rng.random() < 0.25:
            self.sessions.append(self.system + self._tokens(self.rng.randrange(64, 400)))
            self.sessions = self.sessions[-12:]
            return self.sessions[-1]
        i = self.rng.randrange(len(self.sessions))
        grown = self.sessions[i] + self._tokens(self.rng.randrange(40, 300))
        if len(grown) > MAX_PROMPT_TOKENS:
            grown = self.system + self._tokens(200)
        self.sessions[i] = grown
        return grown

    def one_request(self) -> None:
        engine = self.engine
        prompt = self.next_prompt()
        rid = f"chat-{self.step}"
        started = time.perf_counter()
        hit = engine.lookup(prompt, rid)
        loaded = engine.retrieve(prompt, rid).shape[2] if hit.tokens else 0
        engine.store(prompt, self.kv[:, :, : len(prompt), :])
        modelled = (time.perf_counter() - started) + (
            len(prompt) - loaded
        ) * self.prefill_s_per_token
        engine.record_ttft(modelled, prompt_tokens=len(prompt), hit_tokens=loaded)
        self.open.append((rid, self.step + self.rng.randrange(0, 6)))

    def end_due(self, final: bool = False) -> None:
        still: deque[tuple[str, int]] = deque()
        for rid, due in self.open:
            if final or due <= self.step:
                self.engine.end_request(rid)
            else:
                still.append((rid, due))
        self.open = still

    def run(self, rate: float, deadline: float | None, stop: threading.Event) -> None:
        try:
            while not stop.is_set() and (deadline is None or time.monotonic() < deadline):
                self.one_request()
                self.end_due()
                self.step += 1
                stop.wait(1.0 / rate)
        finally:
            self.end_due(final=True)
