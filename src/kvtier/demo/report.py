"""The demo's table: TTFT per configuration, speedup, hit rate and bytes per tier."""

from __future__ import annotations

import numpy as np

from kvtier.demo.runner import ConfigRun, DemoResult


def percentile_ms(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values) * 1000.0, q)) if values else 0.0


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError("unreachable")


def _tiers(run: ConfigRun) -> str:
    if not run.tier_bytes:
        return "-"
    used = ", ".join(f"{name} {_bytes(b)}" for name, b in run.tier_bytes.items())
    hits = ", ".join(f"{name} {t}" for name, t in run.hit_tokens_by_tier.items() if t)
    return f"{used}; hits from {hits}" if hits else used


def format_table(result: DemoResult) -> str:
    base = result.configs[0]
    base_mean = float(np.mean(base.ttfts())) if base.records else 0.0
    header = (
        "configuration",
        "TTFT p50",
        "TTFT p95",
        "p50 rounds 2+",
        "speedup",
        "hit rate",
        "tiers",
    )
    rows = [header]
    for run in result.configs:
        mean = float(np.mean(run.ttfts())) if run.records else 0.0
        rows.append(
            (
                run.label,
                f"{percentile_ms(run.ttfts(), 50):.0f} ms",
                f"{percentile_ms(run.ttfts(), 95):.0f} ms",
                f"{percentile_ms([r.ttft_s for r in run.records if r.round > 0], 50):.0f} ms",
                f"{base_mean / mean:.1f}x" if mean else "-",
                f"{100 * run.hit_rate():.0f}%",
                _tiers(run),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    lines = []
    for index, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])]
        cells += [cell.rjust(width) for cell, width in zip(row[1:-1], widths[1:], strict=True)]
        lines.append("  ".join([*cells, row[-1]]))
        if index == 0:
            lines.append("-" * len(lines[0]))
    return "\n".join(lines)


def summary(result: DemoResult) -> str:
    w = result.workload
    return (
        f"model {result.model}; {w.users} users x {w.rounds} rounds; system prompt "
        f"{w.system_tokens} + context {w.context_tokens} tokens per user, question "
        f"{w.question_tokens}, answer {w.answer_tokens}; prompts up to {w.max_prompt_tokens()} "
        "tokens; speedup = mean TTFT without kvtier / mean TTFT (all rounds); hit rate = prompt "
        "tokens reused; rounds 2+ = once each user's history is in the cache"
    )
