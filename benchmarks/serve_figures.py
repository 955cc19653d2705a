"""The figures of ``python -m benchmarks serve`` (:mod:`benchmarks.serve`), from its tables
(workload -> configuration -> pass -> row): the headline ratios, the problems, and the medians
over rounds.

Top-level fields (``cold`` is ``none``; the headline workload is ``prefix`` if it ran)::

    ttft_efficiency_<c>  = (cold - c) / (cold - apc)  pass-2 mean TTFT; 1.0: as good as vLLM's
    ttft_vs_apc_<c>      = c / apc                    pass-2 mean TTFT of a hit against vLLM's
                                                       own hit (what the efficiency hides when
                                                       the cold prefill is long)
    server_vs_inprocess  = ttft_efficiency_server / ttft_efficiency_cpu
    e2e_throughput_vs_example = cpu / example   output tokens/s of the decode workload (no
    e2e_throughput_vs_none    = cpu / none      hit anywhere), or of pass 1 without it
    outputs_equal_<c>    share of pass-2 completions identical to ``none``'s (greedy)
    hit_share_<c>        share of pass-2 prompt tokens served from a cache (vLLM's or the
                         connector's, from vLLM's /metrics)
    problems             every pass whose counters disagree with what its row claims (kvtier
                         served nothing, or from another tier; a cache hit with no cache;
                         failed requests): empty when every figure measured what it says

``--repeats N``: :func:`merge_rounds` takes each number's median over the rounds that have it;
:func:`per_round` keeps each headline ratio as measured within each round alone.
"""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.serve_plans import KVTIER_CONFIGS


def efficiency(cold: float, cached: float, ideal: float) -> float:
    """(cold - cached) / (cold - ideal): the share of the ideal saving that ``cached`` gets."""
    saved = cold - ideal
    return round((cold - cached) / saved, 3) if saved > 0 else float("nan")


def top_level(
    table: dict[str, dict[str, Any]],
    texts: dict[str, list[str]],
    throughput_table: dict[str, dict[str, Any]] | None = None,
    measured: str = "pass2",
) -> dict[str, Any]:
    """The headline ratios from one workload's table (config -> pass -> summary), compared
    in its ``measured`` pass; throughput from ``throughput_table`` (the hit-free decode
    workload) when given, else pass 1."""
    out: dict[str, Any] = {}

    def ttft(config: str) -> float | None:
        row = table.get(config, {}).get(measured)
        return None if row is None else float(row["mean_ttft_ms"])

    def throughput(config: str) -> float | None:
        row = (throughput_table or table).get(config, {}).get("pass1")
        return None if row is None else float(row["output_throughput"])

    cold, ideal = ttft("none"), ttft("apc")
    for config in ("cpu", "disk", "redis", "server", "example"):
        value = ttft(config)
        if ideal is None or value is None:
            continue
        if cold is not None:  # the efficiency needs the cold run; the ratio to apc does not
            out[f"ttft_efficiency_{config}"] = efficiency(cold, value, ideal)
        out[f"ttft_vs_apc_{config}"] = round(value / ideal, 3) if ideal else float("nan")
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
    for config, passes in table.items():
        row = passes.get(measured, {})
        if row.get("prompt_tokens"):
            hit = row.get("vllm_cached_tokens", 0) + row.get("connector_tokens", 0)
            out[f"hit_share_{config}"] = round(hit / row["prompt_tokens"], 3)
    return out


def problems(
    table: dict[str, dict[str, dict[str, Any]]], measured: dict[str, str] | None = None
) -> list[str]:
    """Every pass whose counters say its figure measured something else (see the module
    docstring); each as a sentence naming the workload, configuration and pass.
    ``measured``: a workload's measured pass where it is not pass 2."""
    out: list[str] = []
    for workload, configs in table.items():
        for config, passes in configs.items():
            for name, row in passes.items():
                where = f"{workload}/{config}/{name}"
                if row.get("failed"):
                    out.append(f"{where}: {row['failed']:g} requests failed")
                if config != "apc" and row.get("vllm_cached_tokens"):
                    out.append(f"{where}: vLLM's prefix cache served with it off")
                if config in ("none", "apc") and row.get("connector_tokens"):
                    out.append(f"{where}: a connector served with none configured")
                if config not in KVTIER_CONFIGS or name != (measured or {}).get(workload, "pass2"):
                    continue
                served = row.get("kvtier_tokens", 0)
                if not served:
                    out.append(f"{where}: kvtier served no token in pass {name[-1]}")
                    continue
                tier = KVTIER_CONFIGS[config]
                by_tier = row.get("kvtier_tokens_by_tier", {})
                if tier is not None and by_tier.get(tier, 0) < served:
                    out.append(f"{where}: {tier} served {by_tier.get(tier, 0)} of {served}")
    return out


def merge_rounds(tables: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """One table (config -> pass -> row) from several rounds' tables: each number is its
    median over the rounds that have it (the counters' dicts are the first round's)."""
    merged: dict[str, dict[str, Any]] = {}
    for table in tables:
        for config, passes in table.items():
            for name in passes:
                merged.setdefault(config, {}).setdefault(name, None)
    for config, passes in merged.items():
        for name in passes:
            rows = [t[config][name] for t in tables if name in t.get(config, {})]
            row: dict[str, Any] = dict(rows[0])
            for key, value in rows[0].items():
                values = [r[key] for r in rows if isinstance(r.get(key), int | float)]
                if isinstance(value, int | float) and len(values) == len(rows):
                    row[key] = round(statistics.median(values), 3)
            passes[name] = row
    return merged


def per_round(rounds: list[dict[str, dict[str, dict[str, Any]]]], headline: str) -> dict[str, Any]:
    """Each headline ratio as measured within each round alone (configurations of one round
    ran minutes apart, so a round's ratio is the least disturbed by the machine's drift)."""
    out: dict[str, list[float]] = {}
    for table in rounds:
        figures = top_level(table.get(headline, {}), {}, table.get("decode"))
        for key, value in figures.items():
            if not key.startswith(("hit_share_", "outputs_equal_")):
                out.setdefault(key, []).append(value)
    return out


def unequal_outputs(result: dict[str, Any], dtype: str) -> list[str]:
    """kvtier's configurations whose greedy completions differ from vLLM alone's: a failure in
    float32, where loaded KV is bit-exact (in bf16 the reference is vLLM's own prefix cache at
    the same hit length, which this workload does not pin down, so it is only reported)."""
    if dtype != "float32":
        return []
    kvtier_configs = ("cpu", "disk", "redis", "server")
    return [
        f"{key}={value}: kvtier's completions differ from vLLM alone's"
        for key, value in result.items()
        if key.startswith("outputs_equal_")
        and key.removeprefix("outputs_equal_") in kvtier_configs
        and value < 1.0
    ]
