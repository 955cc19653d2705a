"""``kvtier bench serve``: vLLM's own serving benchmark against vLLM's OpenAI server, per
cache configuration, on a model shape whose KV is big enough for loads to matter.

Every configuration starts ``python -m vllm.entrypoints.openai.api_server`` (one at a time,
``VLLM_CPU_KVCACHE_SPACE`` from the environment or 1 GiB, ``--enforce-eager``) and runs
vLLM's serving benchmark (``vllm.benchmarks.serve.main``) against it twice with the same
requests: pass 1 on an empty cache, pass 2 measured with what pass 1 left::

    config        vLLM prefix cache  connector                       pass 2 runs in
    none          off                none                            the same vLLM
    apc           on                 none                            the same vLLM
    cpu           off                kvtier, CPU tier                the same vLLM
    disk          off                kvtier, disk only (CPU staging) a fresh vLLM
    redis         off                kvtier, redis only              a fresh vLLM
    server        off                kvtier through a kvtier server  a fresh vLLM (server warm)
    example       off                vLLM's ExampleConnector         the same vLLM

Workloads (``--workload``): ``prefix`` is vLLM's prefix_repetition dataset (``--num-prefixes``
prefixes of ``--prefix-len`` tokens, ``--suffix-len``-token suffixes); ``chat`` is a multi-round
chat written as a custom dataset: ``--users`` conversations of ``--rounds`` rounds, each round's
prompt is the previous prompt, a ``--answer-words`` answer and a new ``--question-words``
question, sent round by round (the history grows, as in LMCache's multi-round QA benchmark).

Top-level fields (pass 2 mean TTFT of the first workload; ``cold`` is ``none``)::

    ttft_efficiency_<c>  = (cold - c) / (cold - apc)       1.0: as good as vLLM's own cache
    server_vs_inprocess  = ttft_efficiency_server / ttft_efficiency_cpu
    e2e_throughput_vs_example = cpu / example   output tokens/s in pass 1 (no hit anywhere)
    e2e_throughput_vs_none    = cpu / none      same
    outputs_equal_<c>    share of pass-2 completions identical to ``none``'s (greedy)

plus ``table``: per workload, configuration and pass, TTFT mean/p50/p99, TPOT mean/p50,
end-to-end latency mean/p50/p99 (ms), request and output throughput.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.bench.isolation import stdout_to_stderr, work_dir
from kvtier.bench.redis import _server as redis_server
from kvtier.testing.checkpoint import words_for
from kvtier.testing.shapes import SHAPES, write_shape

CONFIGS = ("none", "apc", "cpu", "disk", "redis", "server", "example")
FRESH = {"disk", "redis", "server"}  # pass 2 in a new vLLM process
SERVED_NAME = "kvtier-bench"
KVTIER = {
    "kv_connector": "KVTierConnector",
    "kv_connector_module_path": "kvtier.integrations.vllm",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
}


def _names(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--configs", type=_names, default=list(CONFIGS))
    parser.add_argument("--workload", type=_names, default=["prefix", "chat"])
    parser.add_argument("--num-prefixes", type=int, default=4)
    parser.add_argument("--prefix-len", type=int, default=4096)
    parser.add_argument("--suffix-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=16, help="prefix workload")
    parser.add_argument("--users", type=int, default=4, help="chat workload")
    parser.add_argument("--rounds", type=int, default=4, help="chat workload")
    parser.add_argument("--system-words", type=int, default=2048, help="chat: shared start")
    parser.add_argument("--question-words", type=int, default=64)
    parser.add_argument("--answer-words", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--request-rate", type=float, default=1.0)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--cpu-size", default="4GiB", help="kvtier CPU tier")
    parser.add_argument("--work-dir", default=None, help="checkpoint, disk tier, logs")


@dataclass
class Plan:
    """One configuration: how to start vLLM (and what it needs beside it)."""

    name: str
    prefix_cache: bool = False
    transfer: dict[str, Any] | None = None
    fresh: bool = False
    needs_redis: bool = False
    needs_server: bool = False
    env: dict[str, str] = field(default_factory=dict)


def plan_for(name: str, work: Path, cpu_size: str, redis_url: str = "", sock: str = "") -> Plan:
    """The vLLM settings of configuration ``name`` (see the module docstring)."""
    if name == "none":
        return Plan(name)
    if name == "apc":
        return Plan(name, prefix_cache=True)
    if name == "cpu":
        extra: dict[str, Any] = {"max_local_cpu_size": cpu_size}
    elif name == "disk":
        extra = {
            "local_cpu": False,
            "max_local_cpu_size": cpu_size,
            "local_disk": str(work / "disk"),
            "max_local_disk_size": "32GiB",
        }
    elif name == "redis":
        extra = {"local_cpu": False, "max_local_cpu_size": cpu_size, "remote_url": redis_url}
    elif name == "server":
        extra = {"server": f"unix://{sock}"}
    elif name == "example":
        transfer = {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(work / "example")},
        }
        return Plan(name, transfer=transfer)
    else:
        raise ValueError(f"configuration {name!r} is unknown; use {', '.join(CONFIGS)}")
    transfer = {**KVTIER, "kv_connector_extra_config": extra}
    return Plan(
        name,
        transfer=transfer,
        fresh=name in FRESH,
        needs_redis=name == "redis",
        needs_server=name == "server",
    )


def chat_prompts(
    users: int,
    rounds: int,
    system_words: int,
    question_words: int,
    answer_words: int,
    vocab: int,
    seed: int = 0,
) -> list[str]:
    """Multi-round chat prompts, round by round: user ``u``'s round ``r`` prompt extends its
    round ``r-1`` prompt with an answer and a new question; all users share the system part."""
    rng = random.Random(seed)

    def words(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    system = words(system_words)
    histories = [system + words(question_words) for _ in range(users)]
    prompts: list[str] = []
    for r in range(rounds):
        for u in range(users):
            if r:
                histories[u] = histories[u] + words(answer_words) + words(question_words)
            prompts.append(words_for(histories[u]))
    return prompts


def efficiency(cold: float, cached: float, ideal: float) -> float:
    """(cold - cached) / (cold - ideal): the share of the ideal saving that ``cached`` gets."""
    saved = cold - ideal
    return round((cold - cached) / saved, 3) if saved > 0 else float("nan")


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


def top_level(table: dict[str, dict[str, Any]], texts: dict[str, list[str]]) -> dict[str, Any]:
    """The headline ratios from one workload's table (config -> pass -> summary)."""
    out: dict[str, Any] = {}

    def ttft(config: str) -> float | None:
        row = table.get(config, {}).get("pass2")
        return None if row is None else float(row["mean_ttft_ms"])

    def throughput(config: str) -> float | None:
        row = table.get(config, {}).get("pass1")
        return None if row is None else float(row["output_throughput"])

    cold, ideal = ttft("none"), ttft("apc")
    for config in ("cpu", "disk", "redis", "server", "example"):
        value = ttft(config)
        if cold is not None and ideal is not None and value is not None:
            out[f"ttft_efficiency_{config}"] = efficiency(cold, value, ideal)
    if "ttft_efficiency_server" in out and out.get("ttft_efficiency_cpu"):
        out["server_vs_inprocess"] = round(
            out["ttft_efficiency_server"] / out["ttft_efficiency_cpu"], 3
        )
    cpu = throughput("cpu")
    for other in ("example", "none"):
        base = throughput(other)
        if cpu is not None and base:
            out[f"e2e_throughput_vs_{other}"] = round(cpu / base, 3)
    reference = texts.get("none")
    for config, generated in texts.items():
        if config != "none" and reference:
            same = sum(a == b for a, b in zip(generated, reference, strict=False))
            out[f"outputs_equal_{config}"] = round(same / len(reference), 3)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    for name in args.configs:
        if name not in CONFIGS:
            raise ValueError(f"--configs: {name!r} is unknown; use {', '.join(CONFIGS)}")
    with stdout_to_stderr(), work_dir(args.work_dir, "kvtier-bench-serve-") as work:
        model = write_shape(work / f"model-{args.shape}", args.shape)
        datasets = datasets_for(args, work)
        table: dict[str, dict[str, dict[str, Any]]] = {w: {} for w in datasets}
        texts: dict[str, dict[str, list[str]]] = {w: {} for w in datasets}
        with contextlib.ExitStack() as stack:
            redis_url = stack.enter_context(redis_server(None)) if "redis" in args.configs else ""
            sock = str(work / "kvtier.sock")
            for name in args.configs:
                plan = plan_for(name, work, args.cpu_size, redis_url, sock)
                server = _KVTierServer(sock, args.cpu_size, work) if plan.needs_server else None
                try:
                    for workload, bench_args in datasets.items():
                        passes, generated = _two_passes(plan, model, args, work, bench_args)
                        table[workload][name] = passes
                        texts[workload][name] = generated
                finally:
                    if server is not None:
                        server.stop()
    first = next(iter(datasets))
    result: dict[str, Any] = {
        "shape": args.shape,
        "dtype": args.dtype,
        "machine_cpus": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        **top_level(table[first], texts[first]),
    }
    for workload in list(datasets)[1:]:
        result[workload] = top_level(table[workload], texts[workload])
    result["table"] = table
    return result


def datasets_for(args: argparse.Namespace, work: Path) -> dict[str, list[str]]:
    """Workload -> the serving benchmark's dataset arguments."""
    out: dict[str, list[str]] = {}
    for workload in args.workload:
        if workload == "prefix":
            out["prefix"] = [
                "--dataset-name", "prefix_repetition",
                "--prefix-repetition-prefix-len", str(args.prefix_len),
                "--prefix-repetition-suffix-len", str(args.suffix_len),
                "--prefix-repetition-num-prefixes", str(args.num_prefixes),
                "--prefix-repetition-output-len", str(args.output_len),
                "--num-prompts", str(args.num_prompts),
            ]  # fmt: skip
        elif workload == "chat":
            vocab = SHAPES[args.shape].vocab
            prompts = chat_prompts(
                args.users,
                args.rounds,
                args.system_words,
                args.question_words,
                args.answer_words,
                vocab,
            )
            path = work / "chat.jsonl"
            with path.open("w") as f:
                for prompt in prompts:
                    f.write(json.dumps({"prompt": prompt, "output_tokens": args.output_len}))
                    f.write("\n")
            out["chat"] = [
                "--dataset-name", "custom",
                "--dataset-path", str(path),
                "--disable-shuffle",
                "--skip-chat-template",
                "--custom-output-len", str(args.output_len),
                "--num-prompts", str(len(prompts)),
            ]  # fmt: skip
        else:
            raise ValueError(f"--workload: {workload!r} is unknown; use prefix, chat")
    return out


def _two_passes(
    plan: Plan, model: Path, args: argparse.Namespace, work: Path, dataset: list[str]
) -> tuple[dict[str, Any], list[str]]:
    results: dict[str, Any] = {}
    texts: list[str] = []
    vllm = _VLLM(plan, model, args, work)
    try:
        for n in (1, 2):
            if n == 2 and plan.fresh:
                vllm.stop()
                vllm = _VLLM(plan, model, args, work)
            raw = _serving_benchmark(vllm.url, model, args, dataset)
            results[f"pass{n}"] = summarize(raw)
            texts = list(raw.get("generated_texts") or [])
    finally:
        vllm.stop()
    return results, texts


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
            "--request-rate", str(args.request_rate),
            "--temperature", "0",
            "--ignore-eos",
            "--disable-tqdm",
            "--seed", "0",
            "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,99",
            *dataset,
        ]
    )  # fmt: skip
    return parsed


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class _VLLM:
    """vLLM's OpenAI API server in its own process group (stopping it stops its engine)."""

    def __init__(self, plan: Plan, model: Path, args: argparse.Namespace, work: Path) -> None:
        port = _free_port()
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model),
            "--served-model-name", SERVED_NAME,
            "--host", "127.0.0.1",
            "--port", str(port),
            "--enforce-eager",
            "--dtype", args.dtype,
            "--max-model-len", str(args.max_model_len),
            "--max-num-batched-tokens", str(args.max_model_len),
            "--seed", "0",
            "--enable-prefix-caching" if plan.prefix_cache else "--no-enable-prefix-caching",
        ]  # fmt: skip
        if plan.transfer is not None:
            transfer = {**plan.transfer, "engine_id": f"bench-serve-{plan.name}-{port}"}
            cmd += ["--kv-transfer-config", json.dumps(transfer)]
        env = {**os.environ, **plan.env}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        self.url = f"http://127.0.0.1:{port}"
        self.log = work / f"vllm-{plan.name}-{port}.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        deadline = time.monotonic() + 600
        while not _healthy(self.url):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = self.log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"vLLM ({plan.name}) did not come up; log:\n{tail}")
            time.sleep(1)

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


class _KVTierServer:
    """``kvtier server`` on a Unix socket, for the ``server`` configuration."""

    def __init__(self, sock: str, cpu_size: str, work: Path) -> None:
        env = {**os.environ, "KVTIER_MAX_LOCAL_CPU_SIZE": cpu_size}
        self.log = work / "kvtier-server.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvtier.cli.main", "server", "--socket", sock],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
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


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False
