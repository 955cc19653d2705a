"""``python -m benchmarks pd-fleet``: prefill/decode disaggregation at fleet scale (xPyD).

Configurations, one after the other, each on fresh vLLM processes (the tiny Llama, float32,
one compute core each through ``VLLM_CPU_OMP_THREADS_BIND``, ``VLLM_CPU_NUM_OF_RESERVED_CPU=1``
as docs/fleet.md says):

    decode-only   one vLLM doing prefill and decode, no connector; requests go to it directly
    xPyD, e.g.    --fleets 2P2D,1P1D: x prefillers and y decoders with docs/fleet.md's xPyD
                  --kv-transfer-config blocks (sizes scaled down), behind docs/fleet.md's
                  vllm-router --vllm-pd-disaggregation command (round robin on the prefillers,
                  random on the decoders); each decoder pulls the request's KV from the
                  prefiller the router chose

1P1D runs the same xPyD configs with one of each, so that against 2P2D only the fleet's size
changes (the pushing 1P1D, a prefiller that names its decoder, is what ``kvtier bench pd``
measures per transport). The requests: ``--requests`` prompts over ``--prefixes`` shared
prefixes of ``--prefix-tokens``, each with its own tail of 40-239 tokens, sent
``--concurrency`` at a time, greedy, ``--max-tokens`` each (``ignore_eos``), streamed: the
TTFT is the client's, through the router (decode-only: direct). A few warm-up requests with
other prompts go first; every counter is the timed run's delta.

Per PD row, kvtier's own counts (each worker's lookup channel): ``pulls``/``pull_failures``
(decoders), ``pulled_chunks`` (received or already held), ``prefill_held_chunks`` (chunks the
prefillers put in their send buffers, copied or shared), ``transfers_served``,
``refused_claims``, ``expired``; ``pulls_from_named_prefiller``: every pull went to the
prefiller whose id starts its transfer id; ``counters_match``: one pull and one served
transfer per request, no failure or refusal, and pulled = held = every prompt's whole chunks;
``buffers_free``: nothing pinned, leaked or held in any buffer afterwards (``problems`` says
what). ``decoder_computed_tokens``/``decoder_kvtier_tokens`` are vLLM's own
``prompt_tokens_by_source`` on the decoders. ``outputs_equal``: every completion's text (the
tiny tokenizer: one word per token) equals decode-only's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness.pd import documented_router, documented_transfer, settled_problems, stats_of
from benchmarks.harness.router import RouterProcess
from benchmarks.harness.vllm_server import SERVED_NAME, VllmServer, free_port
from benchmarks.isolation import stdout_to_stderr, work_dir
from kvtier.demo.checkpoint import TinyLlama, words_for, write_tiny_llama

WARMUP_TOKENS = 300


def parse_fleets(text: str) -> list[tuple[int, int]]:
    """``"2P2D,1P1D"`` -> ``[(2, 2), (1, 1)]``: prefillers and decoders per fleet."""
    fleets = []
    for part in (p.strip() for p in text.split(",")):
        match = re.fullmatch(r"(\d+)P(\d+)D", part, re.IGNORECASE)
        if match is None or min(int(match.group(1)), int(match.group(2))) < 1:
            raise argparse.ArgumentTypeError(
                f"--fleets: {part!r} is not xPyD with x, y >= 1 (e.g. 2P2D,1P1D)"
            )
        fleets.append((int(match.group(1)), int(match.group(2))))
    return fleets


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fleets", type=parse_fleets, default="2P2D,1P1D", help="e.g. 2P2D,1P1D")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prefixes", type=int, default=4, help="shared prefixes")
    parser.add_argument("--prefix-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=16, help="output tokens per request")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    parser.add_argument("--chunk-size", type=int, default=256, help="kvtier's chunk (tokens)")
    parser.add_argument("--cpu-size", default="64MiB", help="kvtier CPU tier per instance")
    parser.add_argument("--pd-buffer-size", default="64MiB", help="send / receive buffer")
    parser.add_argument("--layers", type=int, default=TinyLlama().num_layers, help="of the model")
    parser.add_argument("--hidden", type=int, default=TinyLlama().hidden, help="of the model")
    parser.add_argument("--work-dir", default=None, help="keep logs here")


def prompts(args: argparse.Namespace, seed: int = 35) -> list[list[int]]:
    """Request ``i``: prefix ``i % prefixes``, then its own tail of 40-239 tokens."""
    rng = random.Random(seed)

    def words(n: int) -> list[int]:
        return [rng.randrange(3, TinyLlama().vocab) for _ in range(n)]

    shared = [words(args.prefix_tokens) for _ in range(args.prefixes)]
    return [shared[i % args.prefixes] + words(40 + (i * 53) % 200) for i in range(args.requests)]


def timing(
    name: str, ttft_s: list[float], wall_s: float, args: argparse.Namespace
) -> dict[str, Any]:
    """The row's client-side figures: TTFT percentiles, wall time, output tokens/s."""
    ms = np.array(ttft_s) * 1e3
    output = len(ttft_s) * args.max_tokens  # ignore_eos: exactly max_tokens each
    return {
        "config": name,
        "requests": len(ttft_s),
        "concurrency": args.concurrency,
        "ttft_p50_ms": round(float(np.percentile(ms, 50)), 1),
        "ttft_p99_ms": round(float(np.percentile(ms, 99)), 1),
        "wall_s": round(wall_s, 2),
        "output_tokens": output,
        "output_tokens_per_s": round(output / wall_s, 1),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    trace = prompts(args)
    load_before = os.getloadavg()
    with stdout_to_stderr(), work_dir(args.work_dir, "kvtier-bench-pd-fleet-") as work:
        shape = TinyLlama(num_layers=args.layers, hidden=args.hidden)
        model = write_tiny_llama(work / "model", shape)
        reference, baseline = _decode_only(args, model, work, trace)
        rows = [baseline]
        for prefillers, decoders in args.fleets:
            rows.append(_pd(args, model, work, trace, (prefillers, decoders), reference))
    pd_rows = rows[1:]
    for row in pd_rows:
        row["ttft_p50_vs_decode_only"] = round(row["ttft_p50_ms"] / baseline["ttft_p50_ms"], 2)
        row["throughput_vs_decode_only"] = round(
            row["output_tokens_per_s"] / baseline["output_tokens_per_s"], 2
        )
    servers = max([p + d for p, d in args.fleets] + [1])
    return {
        "machine": {
            "cpus": os.cpu_count(),
            "load_before": [round(x, 2) for x in load_before],
            "load_after": [round(x, 2) for x in os.getloadavg()],
            "note": f"up to {servers} vLLM servers and vllm-router share {os.cpu_count()} cores "
            "(one compute core each): PD's mechanics and correctness, not its speed-up",
        },
        "model": f"tiny Llama, random weights, float32: {args.layers} layers, hidden {args.hidden}",
        "requests": len(trace),
        "prompt_tokens": sum(len(p) for p in trace),
        "max_tokens": args.max_tokens,
        "all_outputs_equal": all(r["outputs_equal"] for r in pd_rows),
        "all_counters_match": all(r["counters_match"] for r in pd_rows),
        "all_buffers_free": all(r["buffers_free"] for r in pd_rows),
        # Any of these makes `python -m benchmarks pd-fleet` exit non-zero (kvtier.cli.bench).
        "problems": [
            f"{row['config']}: {what}"
            for row in pd_rows
            for what, ok in (
                ("outputs differ from one vLLM's", row["outputs_equal"]),
                ("kvtier's counters do not match vLLM's", row["counters_match"]),
                ("PD buffers not free after the run", row["buffers_free"]),
            )
            if not ok
        ],
        "rows": rows,
    }


@dataclass
class PdServer(VllmServer):
    """A vLLM with a whole ``--kv-transfer-config`` (a PD role), not the fleet's kv_both."""

    transfer: dict[str, Any] = field(default_factory=dict)

    def command(self) -> list[str]:
        return [*super().command(), "--kv-transfer-config", json.dumps(self.transfer)]


def stream(url: str, prompt: str, max_tokens: int, timeout: float = 600) -> tuple[float, str]:
    """A greedy streamed completion: (seconds to its first event, its whole text)."""
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    body |= {"ignore_eos": True, "stream": True}
    request = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    start = time.perf_counter()
    first: float | None = None
    text = ""
    with urllib.request.urlopen(request, timeout=timeout) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if first is None:
                first = time.perf_counter() - start
            text += "".join(c.get("text", "") for c in json.loads(line[6:])["choices"])
    return (first if first is not None else time.perf_counter() - start), text


def drive(
    url: str, trace: list[list[int]], args: argparse.Namespace
) -> tuple[list[float], list[str], float]:
    """Every prompt, ``--concurrency`` at a time: TTFTs and texts in trace order, wall time."""
    start = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        results = list(pool.map(lambda p: stream(url, words_for(p), args.max_tokens), trace))
    wall = time.perf_counter() - start
    return [r[0] for r in results], [r[1] for r in results], wall


def warmup(url: str, count: int, args: argparse.Namespace) -> None:
    """``count`` requests one by one, with prompts the trace does not share: each server's
    first step is paid here, not in the timed run."""
    rng = random.Random(7)
    for _ in range(count):
        prompt = [rng.randrange(3, TinyLlama().vocab) for _ in range(WARMUP_TOKENS)]
        stream(url, words_for(prompt), args.max_tokens)


def _decode_only(
    args: argparse.Namespace, model: Path, work: Path, trace: list[list[int]]
) -> tuple[list[str], dict[str, Any]]:
    server = VllmServer("decode-only", model, work, events=False, core="0")
    try:
        server.start().wait_ready()
        warmup(server.url, 2, args)
        ttft, texts, wall = drive(server.url, trace, args)
    finally:
        server.stop()
    return texts, {**timing("decode-only", ttft, wall, args), "prefillers": 0, "decoders": 0}


def _pd(
    args: argparse.Namespace,
    model: Path,
    work: Path,
    trace: list[list[int]],
    shape: tuple[int, int],
    reference: list[str],
) -> dict[str, Any]:
    p, d = shape
    name, cores = f"{p}P{d}D", os.cpu_count() or 1
    extra = {"max_local_cpu_size": args.cpu_size, "pd_buffer_size": args.pd_buffer_size}
    extra["chunk_size"] = args.chunk_size

    def server(role: str, i: int, core: int) -> PdServer:
        engine_id = f"bench-{name}-{role[5]}{i}-{os.getpid()}"  # names its lookup socket
        transfer = documented_transfer(role, engine_id, **extra)
        return PdServer(f"{name}-{role[5:]}-{i}", model, work, core=str(core % cores),
                        events=False, transfer=transfer)  # fmt: skip

    prefillers = [server("xPyD prefiller", i, i) for i in range(p)]
    decoders = [server("xPyD decoder", i, p + i) for i in range(d)]
    fleet = prefillers + decoders
    router: RouterProcess | None = None
    try:
        for s in fleet:
            s.start()
        for s in fleet:
            s.wait_ready()
        port = free_port()
        command = documented_router([s.url for s in prefillers], [s.url for s in decoders], port)
        router = RouterProcess(command, port, work / f"router-{name}.log")
        router.wait_ready()
        warmup(router.url, 2 * max(p, d), args)
        before = _counters(prefillers, decoders)
        ttft, texts, wall = drive(router.url, trace, args)
        _settle(decoders, before["decoder_tokens"], sum(len(t) for t in trace))
        after = _counters(prefillers, decoders)
        found = settled_problems([s.transfer["engine_id"] for s in fleet], wait_s=15)
    finally:
        if router is not None:
            router.stop()
        for s in fleet:
            s.stop()
    row = {**timing(name, ttft, wall, args), "prefillers": p, "decoders": d}
    row |= _verdict(before, after, trace, args.chunk_size)
    mismatched = sum(a != b for a, b in zip(texts, reference, strict=True))
    row |= {"outputs_equal": mismatched == 0, "outputs_mismatched": mismatched}
    return row | {"buffers_free": not found, "problems": found[:10]}


def _counters(prefillers: list[PdServer], decoders: list[PdServer]) -> dict[str, Any]:
    """kvtier's PD counts over the fleet, so far (the lookup channels), and vLLM's prompt
    tokens by source on the decoders (their /metrics)."""
    sources = {s.transfer["engine_id"]: stats_of(s.transfer["engine_id"])["pd_source"]
               for s in prefillers}  # fmt: skip
    pulls = [stats_of(s.transfer["engine_id"])["pd_pulls"] for s in decoders]
    tokens = [s.prompt_tokens() for s in decoders]
    return {
        "served": sum(s["served"] for s in sources.values()),
        "refused_claims": sum(s["refused_claims"] for s in sources.values()),
        "expired": sum(s["expired"] for s in sources.values()),
        "held": sum(s["held_chunks"] + s["shared_chunks"] for s in sources.values()),
        "pulls": sum(p["pulls"] for p in pulls),
        "failures": sum(p["failures"] for p in pulls),
        "recent": [p["recent"] for p in pulls],
        "address": {engine_id: f"{s['host']}:{s['port']}" for engine_id, s in sources.items()},
        "decoder_tokens": {key: sum(t[key] for t in tokens) for key in tokens[0]},
    }


def _settle(decoders: list[PdServer], before: dict[str, int], prompt_tokens: int) -> None:
    """Until the decoders' /metrics count the run's prompt tokens (vLLM hands stats to its
    API process asynchronously), for up to 15 s."""
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        now = [s.prompt_tokens() for s in decoders]
        if sum(sum(t.values()) for t in now) - sum(before.values()) >= prompt_tokens:
            return
        time.sleep(0.2)


def _verdict(
    before: dict[str, Any], after: dict[str, Any], trace: list[list[int]], chunk: int
) -> dict[str, Any]:
    """The run's deltas, and whether they are what the trace must give."""
    delta = {k: after[k] - before[k] for k in after if isinstance(after[k], int)}
    pulls = [pull for old, new in zip(before["recent"], after["recent"], strict=True)
             for pull in new[len(old):]]  # fmt: skip
    named = [
        next((a for e, a in after["address"].items() if tid.startswith(e[:64] + "-")), None)
        for tid, _, _, _ in pulls
    ]
    from_named = all(n == source for n, (_, source, _, _) in zip(named, pulls, strict=True))
    pulled = sum(chunks for _, _, chunks, _ in pulls)
    expected = sum(len(t) // chunk for t in trace)
    requests = len(trace)
    tokens = {
        k: after["decoder_tokens"][k] - before["decoder_tokens"][k]
        for k in before["decoder_tokens"]
    }
    return {
        "pulls": delta["pulls"],
        "pull_failures": delta["failures"],
        "pulled_chunks": pulled,
        "pulled_tokens": pulled * chunk,
        "expected_chunks": expected,
        "prefill_held_chunks": delta["held"],
        "transfers_served": delta["served"],
        "refused_claims": delta["refused_claims"],
        "expired": delta["expired"],
        "pulls_from_named_prefiller": from_named,
        "counters_match": from_named
        and delta["pulls"] == delta["served"] == len(pulls) == requests
        and delta["failures"] == delta["refused_claims"] == 0
        and pulled == delta["held"] == expected
        and all(ok for _, _, _, ok in pulls),
        "decoder_computed_tokens": tokens["local_compute"],
        "decoder_kvtier_tokens": tokens["external_kv_transfer"],
        "decoder_prefix_cache_tokens": tokens["local_cache_hit"],
    }
