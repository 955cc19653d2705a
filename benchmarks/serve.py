"""``python -m benchmarks serve``: vLLM's own serving benchmark against vLLM's OpenAI server, per
cache configuration, on a model shape whose KV is big enough for loads to matter.

Every configuration starts ``python -m vllm.entrypoints.openai.api_server`` (one at a time,
``VLLM_CPU_KVCACHE_SPACE`` from the environment or 1 GiB, ``--enforce-eager``, the whole
prompt in one prefill step), warms it up with one short request, and runs vLLM's serving
benchmark (``vllm.benchmarks.serve.main``) against it: pass 1 runs every workload on an empty
cache, pass 2 runs the repeatable ones again with what pass 1 left (``none``, which has no
cache, runs them once, as pass 2)::

    config        vLLM prefix cache  connector                       pass 2 runs in
    none          off                none                            the same vLLM
    apc           on                 none                            the same vLLM
    cpu           off                kvtier, CPU tier                the same vLLM
    disk          off                kvtier, disk only (CPU staging) a fresh vLLM
    redis         off                kvtier, redis only              a fresh vLLM
    server        off                kvtier through a kvtier server  a fresh vLLM (server warm)
    example       off                vLLM's ExampleConnector         the same vLLM

Workloads: see :mod:`benchmarks.workloads` (``prefix``, ``chat``, ``conversation``,
``decode``). Requests go
``--max-concurrency`` (1) at a time, so a time to first token is a prefill (or a load), not a
wait in vLLM's queue. ``--reserved-cpus`` (1) is vLLM's ``VLLM_CPU_NUM_OF_RESERVED_CPU`` for
every configuration; ``vllm`` leaves vLLM's default, which on 2 cores with a connector
configured gives the worker the scheduler's core too (docs/vllm.md, "Decode with a connector
configured").

Top-level fields, ``problems`` and the medians over rounds: :mod:`benchmarks.serve_figures`.

``--repeats N`` runs every configuration N times, in rounds of alternating order (forward,
backward, ...), each round on empty tiers of its own: every figure is then the median over
the rounds, ``per_round`` lists each headline ratio as measured within each round alone, and
``rounds`` keeps each round's table (on a shared, noisy machine one configuration swings by
20% between runs minutes apart: a comparison that matters takes several rounds).

plus ``table``: per workload, configuration and pass, TTFT mean/p50/p99, TPOT mean/p50,
end-to-end latency mean/p50/p99 (ms), request and output throughput, and the pass's counters
(``prompt_tokens``, ``vllm_cached_tokens``, ``connector_tokens``, ``kvtier_tokens`` and
``kvtier_tokens_by_tier``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from pathlib import Path
from typing import Any

from benchmarks import conversation
from benchmarks import workloads as wl
from benchmarks.harness.shapes import SHAPES, write_shape
from benchmarks.isolation import stdout_to_stderr, work_dir
from benchmarks.serve_figures import (
    merge_rounds,
    per_round,
    problems,
    top_level,
    unequal_outputs,
)
from benchmarks.serve_plans import CONFIGS, KVTIER_CONFIGS, Plan, plan_for
from benchmarks.serving import SERVED_NAME, KVTierServer, VLLMServer, counter_delta
from kvtier.bench.redis import _server as redis_server


def _names(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--configs", type=_names, default=list(CONFIGS))
    parser.add_argument("--workload", type=_names, default=["prefix", "chat", "decode"])
    wl.add_arguments(parser)
    parser.add_argument("--max-concurrency", type=int, default=1)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--cpu-size", default="4GiB", help="kvtier CPU tier")
    parser.add_argument(
        "--chunk-size",
        type=int,
        default=None,
        help="kvtier's chunk in tokens (default: the connector's choice, vLLM's block on its "
        "CPU build, 128, which reuses a prompt as finely as vLLM's own prefix cache)",
    )
    parser.add_argument(
        "--save-decode-cache",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="whether kvtier also stores each request's answer (default: the config's, on)",
    )
    parser.add_argument(
        "--codec",
        default=None,
        help="payload codec of the disk and redis configurations' tiers (identity, lossless, "
        "fp8, int8; default: kvtier's, identity)",
    )
    parser.add_argument(
        "--reserved-cpus", default="1", help="VLLM_CPU_NUM_OF_RESERVED_CPU, or 'vllm' (unset)"
    )
    parser.add_argument("--work-dir", default=None, help="checkpoint, disk tier, logs")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds of every configuration, alternating their order; figures are medians",
    )


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """The fields of one vLLM serving-benchmark result that the table keeps."""
    keys = (
        "mean_ttft_ms",
        "median_ttft_ms",
        "p99_ttft_ms",
        "mean_tpot_ms",
        "median_tpot_ms",
        "mean_e2el_ms",
        "median_e2el_ms",
        "p99_e2el_ms",
        "request_throughput",
        "output_throughput",
        "completed",
        "failed",
    )
    return {k: round(float(result[k]), 3) for k in keys if result.get(k) is not None}


def run(args: argparse.Namespace) -> dict[str, Any]:
    for name in args.configs:
        if name not in CONFIGS:
            raise ValueError(f"--configs: {name!r} is unknown; use {', '.join(CONFIGS)}")
    if args.repeats < 1:
        raise ValueError(f"--repeats is {args.repeats}; use 1 or more")
    loads: list[float] = []
    failed: list[str] = []
    rounds: list[dict[str, dict[str, dict[str, Any]]]] = []
    with stdout_to_stderr(), work_dir(args.work_dir, "kvtier-bench-serve-") as work:
        model = write_shape(work / f"model-{args.shape}", args.shape)
        workloads = wl.workloads_for(args, work)
        names = [w.name for w in workloads]
        texts: dict[str, dict[str, list[str]]] = {w: {} for w in names}
        for index in range(args.repeats):
            # Alternate the order (forward, backward, ...): a drift in the machine's speed
            # then lands on every configuration alike instead of on the last ones.
            order = args.configs if index % 2 == 0 else list(reversed(args.configs))
            # Each round on empty tiers of its own: a disk or Redis that kept the previous
            # round's chunks would turn its pass 1 into hits.
            where = work if args.repeats == 1 else work / f"round-{index + 1}"
            where.mkdir(parents=True, exist_ok=True)
            table: dict[str, dict[str, dict[str, Any]]] = {w: {} for w in names}
            with contextlib.ExitStack() as stack:
                redis_url = stack.enter_context(redis_server(None)) if "redis" in order else ""
                sock = str(where / "kvtier.sock")
                for name in order:
                    plan = plan_for(
                        name,
                        where,
                        args.cpu_size,
                        redis_url,
                        sock,
                        args.chunk_size,
                        args.save_decode_cache,
                        args.codec,
                    )
                    try:
                        done = _configuration(plan, model, args, where, workloads, sock)
                        for workload, passes, generated in done:
                            table[workload][name] = passes
                            texts[workload].setdefault(name, []).extend(generated)
                    except Exception as exc:  # one configuration failing must not lose others
                        failed.append(f"{name}: {type(exc).__name__}: {str(exc)[-500:]}")
                    loads.append(os.getloadavg()[0])
                    partial = {"load_avg_1m": loads, "failed": failed, "rounds": [*rounds, table]}
                    (work / "serve-partial.json").write_text(json.dumps(partial, indent=1))
            rounds.append(table)
    headline = "prefix" if "prefix" in names else names[0]
    merged = {w: merge_rounds([r[w] for r in rounds]) for w in names}
    measured = {w.name: w.measured for w in workloads}
    result: dict[str, Any] = {
        "shape": args.shape,
        "dtype": args.dtype,
        "reserved_cpus": args.reserved_cpus,
        "chunk_size": args.chunk_size,
        "codec": args.codec,
        "machine_cpus": os.cpu_count(),
        "repeats": args.repeats,
        "load_avg_1m": [round(x, 2) for x in loads],  # after each configuration
        "headline_workload": headline,
        **top_level(merged[headline], texts[headline], merged.get("decode"), measured[headline]),
    }
    for workload in names:
        if workload != headline:
            result[workload] = top_level(
                merged[workload], texts[workload], merged.get("decode"), measured[workload]
            )
    result["problems"] = failed + unequal_outputs(result, args.dtype)
    for index, table in enumerate(rounds):
        label = f"round {index + 1}: " if args.repeats > 1 else ""
        result["problems"] += [label + p for p in problems(table, measured)]
    if args.repeats > 1:
        result["per_round"] = per_round(rounds, headline)
        result["rounds"] = rounds
    result["table"] = merged
    return result


def _configuration(
    plan: Plan,
    model: Path,
    args: argparse.Namespace,
    work: Path,
    workloads: list[wl.Workload],
    sock: str,
) -> list[tuple[str, dict[str, Any], list[str]]]:
    """Every pass of one configuration (with its kvtier server around it, if it has one)."""
    server = None
    if plan.needs_server:
        server = KVTierServer(sock, args.cpu_size, work, args.chunk_size)
    try:
        return _passes(plan, model, args, work, workloads)
    finally:
        if server is not None:
            server.stop()


def _passes(
    plan: Plan, model: Path, args: argparse.Namespace, work: Path, workloads: list[wl.Workload]
) -> list[tuple[str, dict[str, Any], list[str]]]:
    """Pass 1 of every workload, then pass 2 of the repeatable ones (in a fresh vLLM for the
    fresh configurations): ``(workload, {pass: row}, pass-2 or pass-1 completions)``."""
    rows: dict[str, dict[str, Any]] = {w.name: {} for w in workloads}
    texts: dict[str, list[str]] = {}
    vllm = _start(plan, model, args, work)
    try:
        for n in (1, 2):
            # Without any cache pass 2 repeats pass 1 exactly: ``none`` runs it once, as pass 2.
            todo = [
                w
                for w in workloads
                if (n == 1 and not (w.repeat and plan.name == "none")) or (n == 2 and w.repeat)
            ]
            if n == 2 and todo and plan.fresh:
                vllm.flush()
                vllm.stop()
                vllm = _start(plan, model, args, work)
            for workload in todo:
                before = vllm.counters()
                if workload.live:
                    raw = conversation.run(vllm.url, SERVED_NAME, args, _vocab(model))
                else:
                    raw = _serving_benchmark(vllm.url, model, args, workload.dataset)
                vllm.flush()  # writes finish before the next figure is taken
                row = summarize(raw)
                row.update(counter_delta(before, vllm.counters()))
                rows[workload.name][f"pass{n}"] = row
                texts[workload.name] = list(raw.get("generated_texts") or [])
    finally:
        vllm.stop()
    return [(w.name, rows[w.name], texts[w.name]) for w in workloads]


def _start(plan: Plan, model: Path, args: argparse.Namespace, work: Path) -> VLLMServer:
    options = [
        "--enforce-eager",
        "--dtype", args.dtype,
        "--max-model-len", str(args.max_model_len),
        "--max-num-batched-tokens", str(args.max_model_len),
        "--seed", "0",
        "--enable-prefix-caching" if plan.prefix_cache else "--no-enable-prefix-caching",
    ]  # fmt: skip
    env = {**os.environ, **plan.env}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.reserved_cpus != "vllm":
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(args.reserved_cpus)
    else:
        env.pop("VLLM_CPU_NUM_OF_RESERVED_CPU", None)
    kvtier = plan.name in KVTIER_CONFIGS
    vllm = VLLMServer(plan.name, model, options, plan.transfer, env, work, kvtier=kvtier)
    try:
        vllm.warm_up()
    except BaseException:
        vllm.stop()
        raise
    return vllm


def _vocab(model: Path) -> int:
    return int(json.loads((model / "config.json").read_text())["vocab_size"])


def _serving_benchmark(
    url: str, model: Path, args: argparse.Namespace, dataset: list[str]
) -> dict[str, Any]:
    from vllm.benchmarks.serve import main

    return dict(main(benchmark_arguments(url, model, args, dataset)))


def benchmark_arguments(
    url: str, model: Path, args: argparse.Namespace, dataset: list[str]
) -> argparse.Namespace:
    """vLLM's serving-benchmark arguments for one pass, parsed by its own parser."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()  # type: ignore[no-untyped-call]
    add_cli_args(parser)
    parsed: argparse.Namespace = parser.parse_args(
        [
            "--backend", "vllm",
            "--base-url", url,
            "--model", SERVED_NAME,
            "--tokenizer", str(model),
            "--request-rate", "inf",
            "--max-concurrency", str(args.max_concurrency),
            "--ready-check-timeout-sec", "0",  # the server is up and warm: no test request
            "--temperature", "0",
            "--ignore-eos",
            "--disable-tqdm",
            "--save-detailed",  # keeps generated_texts in the result (nothing is written)
            "--seed", "0",
            "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,99",
            *dataset,
        ]
    )  # fmt: skip
    return parsed
