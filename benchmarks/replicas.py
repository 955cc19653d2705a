"""``python -m benchmarks replicas``: two vLLM replicas on one host, one ``kvtier server``.

What vLLM issue #58240 asks for (sharing the CPU prefix cache across a host's data-parallel
replicas), measured. Two vLLM OpenAI servers on loopback, one core each, vLLM's own prefix
cache on (a small device KV cache, ``--device-blocks``), vllm-router in front
(:mod:`benchmarks.harness.router`). Configurations:

    plain    vLLM alone: each replica its own prefix cache
    cpu      + kvtier, a CPU tier inside each replica
    server   + kvtier, both replicas on ONE ``kvtier server`` (``{"server": "unix://…"}``)
    redis    + kvtier, a CPU tier each and one shared Redis tier (not run by default)

The workload: ``--prefixes`` long prefixes (``--prefix-tokens``, whole kvtier chunks), each
sent ``--repeats`` times with a fresh ``--suffix-tokens`` question, prefix after prefix::

    p0+q  p1+q  p2+q  p0+q'  p1+q'  p2+q'  …      (an odd number of prefixes)

so round-robin sends every repeat to the replica that did NOT see the prefix last time.
Two phases per configuration, on the same two replicas:

1. **Routed**, per policy (``round_robin``, ``cache_aware``, ``kv_aware``; each its own token
   ids): ``prefill_tokens`` is what the replicas computed (vLLM's
   ``prompt_tokens_by_source{source="local_compute"}``), ``ideal_tokens`` every distinct
   prefix once (the workload's token trie). Outputs are greedy (``--output-tokens``).
2. **Directed** TTFT (no router: the placement is the point), ``--ttft-prefixes`` fresh
   prefixes, the replicas' roles swapped each time (after one discarded warm-up round)::

       cold       replica A, first sight of the prefix
       other      replica B, which never saw it (what round-robin does)
       device     A again: vLLM's own prefix cache
       kvtier     A again after ``/reset_prefix_cache`` (vLLM's cache only): a local kvtier
                  hit (plain: a recompute)

   ``other`` runs second or last in alternate pairs of rounds, and each measured request
   follows a 32-token request to the same replica (equally awake engines). TTFT is the
   client's wall time of a one-token completion (median and spread over the rounds); each
   phase's prompt tokens by source are recorded beside it, so a figure cannot silently
   measure another path.
   ``other_over_local_hit`` is other / kvtier (plain: other / device).

Between requests each replica's kvtier writes land (``flush`` over its worker channel) and
the router gets 0.2 s for the step's KV events: no count depends on timing. Every output is
compared with the plain configuration's for the same prompt; a difference is a problem (the
command exits non-zero).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.fleet import POLICIES, ideal_tokens, prefill_row
from benchmarks.harness.router import Router
from benchmarks.harness.vllm_server import SERVED_NAME, VllmServer, post
from benchmarks.isolation import stdout_to_stderr, work_dir
from benchmarks.serving import KVTierServer
from kvtier.bench.redis import _server as redis_server
from kvtier.demo.checkpoint import SIZES, words_for, write_tiny_llama

CONFIGS = ("plain", "cpu", "server", "redis")
KVTIER_CONFIGS = ("cpu", "server", "redis")
PHASES = ("cold", "other", "device", "kvtier")
# The targets (the server configuration must meet them).
COMPUTED_OVER_IDEAL_MAX = 1.05
OTHER_OVER_LOCAL_MAX = 1.1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--configs", default="plain,cpu,server", help=", ".join(CONFIGS))
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--prefix-tokens", type=int, default=3072, help="whole kvtier chunks")
    parser.add_argument("--suffix-tokens", type=int, default=64)
    parser.add_argument("--prefixes", type=int, default=3, help="odd: round-robin alternates")
    parser.add_argument("--repeats", type=int, default=2, help="requests per prefix (routed)")
    parser.add_argument("--ttft-prefixes", type=int, default=8, help="directed TTFT rounds")
    parser.add_argument("--output-tokens", type=int, default=8, help="greedy, routed phase")
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument(
        "--device-blocks", type=int, default=64, help="vLLM KV blocks per replica (128 tokens)"
    )
    parser.add_argument("--cpu-size", default="512MiB", help="each CPU tier / the server's")
    parser.add_argument("--model-size", default="tiny", choices=sorted(SIZES))
    parser.add_argument("--work-dir", default=None, help="keep logs here")


def workload(args: argparse.Namespace, seed: int) -> list[list[int]]:
    """Every prefix once with a fresh suffix, ``repeats`` times over (see the docstring)."""
    rng = random.Random(seed)
    vocab = SIZES[args.model_size].vocab

    def words(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    prefixes = [words(args.prefix_tokens) for _ in range(args.prefixes)]
    return [p + words(args.suffix_tokens) for _ in range(args.repeats) for p in prefixes]


def check_arguments(args: argparse.Namespace) -> None:
    unknown = set(_names(args.configs)) - set(CONFIGS)
    if unknown:
        raise SystemExit(f"replicas: unknown configs {sorted(unknown)}; use {', '.join(CONFIGS)}")
    if args.prefix_tokens % args.chunk_size or args.prefix_tokens % 128:
        raise SystemExit("replicas: --prefix-tokens must be whole chunks and whole vLLM blocks")
    if args.prefix_tokens + args.suffix_tokens + args.output_tokens > 4096:
        raise SystemExit("replicas: a prompt and its output must fit vLLM's 4096-token context")


def _names(text: str) -> list[str]:
    return [n for n in text.split(",") if n]


def run(args: argparse.Namespace) -> dict[str, Any]:
    check_arguments(args)
    configs = _names(args.configs)
    rows: list[dict[str, Any]] = []
    ttft: list[dict[str, Any]] = []
    texts: dict[str, dict[str, str]] = {}
    loads = {"start": _load()}  # the host's load average (1, 5, 15 min), as `uptime` says
    with stdout_to_stderr(), work_dir(args.work_dir, "kvtier-bench-replicas-") as work:
        model = write_tiny_llama(work / "model", SIZES[args.model_size])
        for name in configs:
            routed, directed, outputs = _configuration(args, work, model, name)
            rows += routed
            ttft.append(directed)
            texts[name] = outputs
            loads[f"after {name}"] = _load()
    wrong = _compare_outputs(texts)
    for row in rows + ttft:
        prefix = f"{row.get('policy', 'ttft')}/"
        mine = wrong.get(row["config"])
        row["outputs_equal_plain"] = (
            None if mine is None else not any(k.startswith(prefix) for k in mine)
        )
    problems = [
        f"{name}: outputs differ from vLLM alone for {len(keys)} prompts: {', '.join(keys[:5])}"
        for name, keys in wrong.items()
        if keys
    ]
    return {
        "prefix_tokens": args.prefix_tokens,
        "suffix_tokens": args.suffix_tokens,
        "prefixes": args.prefixes,
        "repeats": args.repeats,
        "model": args.model_size,
        "load": loads,
        **summary(rows, ttft),
        "rows": rows,
        "ttft": ttft,
        "problems": problems,
    }


def summary(rows: list[dict[str, Any]], ttft: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's three figures for the server configuration, and what they are against."""
    out: dict[str, Any] = {}
    server = [r for r in rows if r["config"] == "server"]
    directed = {t["config"]: t for t in ttft}
    if server:
        worst = max(r["computed_over_ideal"] for r in server)
        out["server_computed_over_ideal_max"] = worst
    if "server" in directed:
        out["server_other_over_local_hit"] = directed["server"]["other_over_local_hit"]
    if "server" in directed and "cpu" in directed:
        # the other replica on the shared server against a hit in a replica's own CPU tier
        out["server_other_over_cpu_local_hit"] = round(
            directed["server"]["ttft_other_ms"] / directed["cpu"]["ttft_kvtier_ms"], 3
        )
    if "server" in directed and "plain" in directed:
        # what sharing buys the replica that never saw the prefix (#58240: 14.41 s -> 5.22 s)
        out["plain_other_over_server_other"] = round(
            directed["plain"]["ttft_other_ms"] / directed["server"]["ttft_other_ms"], 3
        )
    if server and "server" in directed:
        out["target_met"] = (
            out["server_computed_over_ideal_max"] <= COMPUTED_OVER_IDEAL_MAX
            and out["server_other_over_local_hit"] <= OTHER_OVER_LOCAL_MAX
            and all(
                r.get("outputs_equal_plain") is not False for r in [*server, directed["server"]]
            )
        )
    return out


@contextlib.contextmanager
def _shared_store(args: argparse.Namespace, work: Path, name: str) -> Iterator[dict[str, Any]]:
    """What a configuration's replicas run beside them; yields their kvtier extra config."""
    if name == "plain":
        yield {}
    elif name == "cpu":
        yield {"max_local_cpu_size": args.cpu_size, "chunk_size": args.chunk_size}
    elif name == "redis":
        with redis_server(None) as url:
            yield {"max_local_cpu_size": args.cpu_size, "chunk_size": args.chunk_size,
                   "remote_url": url}  # fmt: skip
    else:
        # a short directory: a Unix socket's path has at most 107 bytes
        with tempfile.TemporaryDirectory(prefix="kvr-", dir="/tmp") as sockets:
            sock = f"{sockets}/kvtier.sock"
            server = KVTierServer(sock, args.cpu_size, work, args.chunk_size)
            try:
                yield {"server": f"unix://{sock}", "chunk_size": args.chunk_size}
            finally:
                server.stop()


def _configuration(
    args: argparse.Namespace, work: Path, model: Path, name: str
) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, str]]:
    """Both phases on one pair of replicas: routed rows, the directed TTFT row, and every
    output by prompt (``policy/index`` and ``ttft/round/phase``)."""
    cpus = _cores()
    outputs: dict[str, str] = {}
    with _shared_store(args, work, name) as extra:
        blocks = ("--num-gpu-blocks-override", str(args.device_blocks))
        replicas = [
            VllmServer(
                f"{name}-{i}",
                model,
                work,
                kvtier=extra or None,
                core=cpus[i % len(cpus)],
                extra_args=blocks,
                env={"VLLM_SERVER_DEV_MODE": "1"},
            )
            for i in range(2)
        ]
        try:
            for replica in replicas:
                replica.start()
            for replica in replicas:
                replica.wait_ready()
            rows = []
            for index, policy in enumerate(_names(args.policies)):
                prompts = workload(args, seed=1000 * (index + 1))
                row, answers = _routed(replicas, policy, work, prompts, args.output_tokens)
                rows.append({"config": name, **row})
                outputs |= {f"{policy}/{i}": t for i, t in enumerate(answers)}
            directed, texts = _directed(args, replicas, kvtier_hit=name != "plain")
            outputs |= texts
        finally:
            for replica in replicas:
                replica.stop()
    return rows, {"config": name, **directed}, outputs


def _cores() -> list[str]:
    """A core for each replica: those the environment binds vLLM to (a test worker's share),
    else those this process may run on."""
    bound = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "").split(",")
    if all(part.isdigit() for part in bound):
        return bound
    return [str(cpu) for cpu in sorted(os.sched_getaffinity(0))]


def _complete(url: str, prompt: list[int], max_tokens: int) -> tuple[float, str]:
    body = {"model": SERVED_NAME, "prompt": words_for(prompt), "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    start = time.perf_counter()
    text = post(f"{url}/v1/completions", body)["choices"][0]["text"]
    return time.perf_counter() - start, str(text)


def _settle(replicas: list[VllmServer]) -> None:
    """Each replica's kvtier writes land; the router gets the step's KV events."""
    for replica in replicas:
        if not replica.flush():
            raise RuntimeError(f"kvtier on {replica.name} did not flush its writes in time")
    time.sleep(0.2)


def _sources(replicas: list[VllmServer]) -> list[dict[str, int]]:
    return [r.prompt_tokens() for r in replicas]


def _delta(after: list[dict[str, int]], before: list[dict[str, int]]) -> dict[str, int]:
    return {k: sum(a[k] - b[k] for a, b in zip(after, before, strict=True)) for k in after[0]}


def _routed(
    replicas: list[VllmServer], policy: str, work: Path, prompts: list[list[int]], out: int
) -> tuple[dict[str, Any], list[str]]:
    router = Router(replicas, policy, work).start()
    texts, wall = [], []
    try:
        before = _sources(replicas)
        for prompt in prompts:
            start = time.perf_counter()
            answer = router.complete(words_for(prompt), max_tokens=out)
            texts.append(str(answer["choices"][0]["text"]))
            wall.append(time.perf_counter() - start)
            _settle(replicas)
        delta = _delta(_sources(replicas), before)
    finally:
        router.stop()
    ideal = ideal_tokens(prompts)
    return {
        "policy": policy,
        **prefill_row(prompts, delta, ideal),
        "latency_p50_ms": round(statistics.median(wall) * 1e3, 1),
    }, texts


def _directed(
    args: argparse.Namespace, replicas: list[VllmServer], *, kvtier_hit: bool
) -> tuple[dict[str, Any], dict[str, str]]:
    """The TTFT rounds (round 0 a warm-up, not counted): per phase the median TTFT, its
    spread and the prompt tokens by source, summed over the counted rounds. The local hit is
    the ``kvtier`` phase with kvtier (``device`` without)."""
    times: dict[str, list[float]] = {p: [] for p in PHASES}
    sources: dict[str, dict[str, int]] = {p: {} for p in PHASES}
    texts: dict[str, str] = {}
    vocab = SIZES[args.model_size].vocab
    for round_ in range(args.ttft_prefixes + 1):
        rng = random.Random(5000 + round_)
        prefix = [rng.randrange(3, vocab) for _ in range(args.prefix_tokens)]
        a, b = replicas[round_ % 2], replicas[1 - round_ % 2]
        for phase in _order(round_):
            replica = b if phase == "other" else a
            if phase == "kvtier":
                replica.reset_prefix_cache()
            prompt = prefix + [rng.randrange(3, vocab) for _ in range(args.suffix_tokens)]
            # A short request first (shorter than a chunk: nothing stored, nothing to hit), so
            # that every measured request finds its replica just as awake: on a loaded host an
            # engine that idled a while answers its next request later.
            _complete(replica.url, [rng.randrange(3, vocab) for _ in range(32)], 1)
            before = replica.prompt_tokens()
            seconds, text = _complete(replica.url, prompt, 1)
            _settle(replicas)
            if round_ == 0:
                continue
            times[phase].append(seconds)
            texts[f"ttft/{round_}/{phase}"] = text
            got = replica.prompt_tokens()
            for key in got:
                sources[phase][key] = sources[phase].get(key, 0) + got[key] - before[key]
    row: dict[str, Any] = {
        f"ttft_{p}_ms": round(statistics.median(times[p]) * 1e3, 1) for p in PHASES
    }
    row |= {f"ttft_{p}_spread_ms": _spread(times[p]) for p in PHASES}
    local = "kvtier" if kvtier_hit else "device"
    row["other_over_local_hit"] = round(row["ttft_other_ms"] / row[f"ttft_{local}_ms"], 3)
    row["local_hit"] = local
    row["sources"] = sources
    return row, texts


def _order(round_: int) -> tuple[str, ...]:
    """The phases of a round: ``other`` before or after A's own hits, every other pair of
    rounds (the roles swap each round), so neither comes first on the same replica."""
    if round_ // 2 % 2:
        return ("cold", "device", "kvtier", "other")
    return PHASES


def _spread(values: list[float]) -> list[float]:
    return [round(min(values) * 1e3, 1), round(max(values) * 1e3, 1)]


def _compare_outputs(texts: dict[str, dict[str, str]]) -> dict[str, list[str]]:
    """Per configuration, the prompts whose output differs from plain vLLM's (none compared
    without a plain run)."""
    if "plain" not in texts:
        return {}
    return {
        name: [k for k, v in outputs.items() if texts["plain"].get(k) != v]
        for name, outputs in texts.items()
    }


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


def format_text(result: dict[str, Any]) -> str:
    lines = ["config  policy       prefill  ideal  computed/ideal  kvtier_hit  outputs=plain"]
    for r in result["rows"]:
        lines.append(
            f"{r['config']:<7} {r['policy']:<12} {r['prefill_tokens']:>7} {r['ideal_tokens']:>6}"
            f" {r['computed_over_ideal']:>15} {r['kvtier_hit_tokens']:>11}"
            f" {r['outputs_equal_plain']!s:>14}"
        )
    lines.append("config  TTFT ms: cold  other  device  kvtier   other/local hit")
    for t in result["ttft"]:
        lines.append(
            f"{t['config']:<7} {t['ttft_cold_ms']:>13} {t['ttft_other_ms']:>6}"
            f" {t['ttft_device_ms']:>7} {t['ttft_kvtier_ms']:>7}"
            f"   {t['other_over_local_hit']} ({t['local_hit']})"
        )
    rest = {k: v for k, v in result.items() if k not in ("rows", "ttft", "problems")}
    lines += [f"{k}: {v}" for k, v in rest.items()]
    return "\n".join(lines)
