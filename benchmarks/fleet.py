"""``python -m benchmarks fleet``: two vLLM instances behind vllm-router, a multi-tenant chat trace.

The fleet (:mod:`benchmarks.harness.router`): two vLLM OpenAI servers on loopback, one core each,
a small device KV cache (``--num-gpu-blocks-override``, so it evicts as a real one does),
KV events on; vllm-router in front. Configurations:

    kvtier=False              vLLM's own prefix cache only
    kvtier=True               + kvtier, a CPU tier per instance (its events feed kv_aware)
    kvtier=True, redis=True   + one Redis tier shared by both instances

and for each, the policies ``round_robin``, ``cache_aware`` and ``kv_aware``. The trace:
``--users`` users (2 system prompts shared by half of them each), ``--rounds`` rounds; round
``r`` of a user is its system prompt, its first message and ``r`` more turns (the history
grows as a chat does). Requests go one at a time (so routing, and with it every count, does
not depend on timing); each policy gets a trace with its own token ids, so no policy reuses
another's cache on the same instances.

Per row: ``prefill_tokens`` is what the fleet computed (vLLM's
``vllm:prompt_tokens_by_source{source="local_compute"}`` summed over instances);
``ideal_tokens`` is every distinct prefix computed once in the fleet (the size of the trace's
token trie); ``device_hit_tokens`` came from vLLM's own prefix cache, ``kvtier_hit_tokens``
from kvtier (CPU or Redis: vLLM counts them as one external source). TTFT is the wall time of
a one-token completion through the router (client side).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness.router import Router
from benchmarks.harness.vllm_server import VllmServer
from benchmarks.isolation import stdout_to_stderr, work_dir
from kvtier.bench.redis import _server as redis_server
from kvtier.demo.checkpoint import TinyLlama, words_for, write_tiny_llama

POLICIES = ("round_robin", "cache_aware", "kv_aware")
CONFIGS = ((False, False), (True, False), (True, True))  # (kvtier, redis)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=512, help="each shared system prompt")
    parser.add_argument("--first-tokens", type=int, default=256, help="a user's first message")
    parser.add_argument("--turn-tokens", type=int, default=128, help="each later turn")
    parser.add_argument(
        "--device-blocks", type=int, default=40, help="vLLM KV blocks per instance (128 tokens)"
    )
    parser.add_argument("--cpu-size", default="512MiB", help="kvtier CPU tier per instance")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--work-dir", default=None, help="keep logs here")


def trace(args: argparse.Namespace, seed: int) -> list[list[int]]:
    """The requests in the order sent: round by round, user by user."""
    rng = random.Random(seed)

    def words(n: int) -> list[int]:
        return [rng.randrange(3, TinyLlama().vocab) for _ in range(n)]

    systems = [words(args.system_tokens) for _ in range(2)]
    history = [systems[u % 2] + words(args.first_tokens) for u in range(args.users)]
    out = []
    for _ in range(args.rounds):
        for user in range(args.users):
            out.append(list(history[user]))
            history[user] += words(args.turn_tokens)
    return out


def prefill_row(prompts: list[list[int]], delta: dict[str, int], ideal: int) -> dict[str, Any]:
    """A row's token counts: what the fleet computed (``delta``: vLLM's prompt tokens by
    source over the row) against the ideal, and where the rest came from."""
    return {
        "requests": len(prompts),
        "prompt_tokens": sum(len(p) for p in prompts),
        "prefill_tokens": delta["local_compute"],
        "ideal_tokens": ideal,
        "computed_over_ideal": round(delta["local_compute"] / ideal, 3),
        "device_hit_tokens": delta["local_cache_hit"],
        "kvtier_hit_tokens": delta["external_kv_transfer"],
    }


def ideal_tokens(prompts: list[list[int]]) -> int:
    """Tokens in the trie of all prompts: each distinct prefix computed once."""
    root: dict[int, Any] = {}
    count = 0
    for prompt in prompts:
        node = root
        for token in prompt:
            if token not in node:
                node[token] = {}
                count += 1
            node = node[token]
    return count


def run(args: argparse.Namespace) -> dict[str, Any]:
    policies = [p for p in args.policies.split(",") if p]
    rows: list[dict[str, Any]] = []
    with stdout_to_stderr(), work_dir(args.work_dir, "kvtier-bench-fleet-") as work:
        model = write_tiny_llama(work / "model")
        for kvtier, redis in CONFIGS:
            rows += _configuration(args, work, model, kvtier, redis, policies)
    baseline = next((r for r in rows if r["policy"] == "cache_aware" and not r["kvtier"]), None)
    best = next((r for r in rows if r["policy"] == "kv_aware" and r["kvtier"]), None)
    summary: dict[str, Any] = {}
    if baseline is not None and best is not None:
        summary = {
            "kv_aware_kvtier_over_ideal": best["computed_over_ideal"],
            "cache_aware_plain_over_ideal": baseline["computed_over_ideal"],
            "target_met": best["computed_over_ideal"] <= 1.2
            and best["prefill_tokens"] < baseline["prefill_tokens"],
        }
    return {
        "users": args.users,
        "rounds": args.rounds,
        "device_blocks": args.device_blocks,
        **summary,
        "rows": rows,
    }


def _configuration(
    args: argparse.Namespace,
    work: Path,
    model: Path,
    kvtier: bool,
    redis: bool,
    policies: list[str],
) -> list[dict[str, Any]]:
    rows = []
    with redis_server(None) if redis else contextlib.nullcontext("") as redis_url:
        extra: dict[str, Any] | None = None
        if kvtier:
            extra = {"max_local_cpu_size": args.cpu_size}
            if redis:
                extra["remote_url"] = redis_url
        name = "kvtier-redis" if redis else "kvtier" if kvtier else "plain"
        blocks = ("--num-gpu-blocks-override", str(args.device_blocks))
        servers = [
            VllmServer(f"{name}-{i}", model, work, kvtier=extra, core=str(i), extra_args=blocks)
            for i in range(2)
        ]
        try:
            for server in servers:
                server.start()
            for server in servers:
                server.wait_ready()
            for index, policy in enumerate(policies):
                prompts = trace(args, seed=1000 * (index + 1))
                rows.append(_one_policy(servers, policy, work, prompts, kvtier, redis))
        finally:
            for server in servers:
                server.stop()
    return rows


def _one_policy(
    servers: list[VllmServer],
    policy: str,
    work: Path,
    prompts: list[list[int]],
    kvtier: bool,
    redis: bool,
) -> dict[str, Any]:
    router = Router(servers, policy, work).start()
    try:
        before = [s.prompt_tokens() for s in servers]
        ttft = []
        for prompt in prompts:
            start = time.perf_counter()
            router.complete(words_for(prompt), max_tokens=1)
            ttft.append(time.perf_counter() - start)
            time.sleep(0.2)  # the step's KV events reach the router before the next request
        after = [s.prompt_tokens() for s in servers]
    finally:
        router.stop()
    delta = {
        key: sum(a[key] - b[key] for a, b in zip(after, before, strict=True)) for key in after[0]
    }
    ideal = ideal_tokens(prompts)
    ms = np.array(ttft) * 1e3
    return {
        "policy": policy,
        "kvtier": kvtier,
        "redis": redis,
        **prefill_row(prompts, delta, ideal),
        "ttft_p50_ms": round(float(np.percentile(ms, 50)), 1),
        "ttft_p99_ms": round(float(np.percentile(ms, 99)), 1),
    }
