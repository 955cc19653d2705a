"""The demo's PNG: time to first token per round, one line per configuration."""

from __future__ import annotations

import numpy as np

from kvtier.demo.runner import DemoResult
from kvtier.errors import InputError


def write_plot(result: DemoResult, path: str) -> None:
    """Median TTFT over users per round (lines) and every request (dots); Agg, no display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    try:
        rounds = np.arange(1, result.workload.rounds + 1)
        for run in result.configs:
            per_round = [
                [1000 * r.ttft_s for r in run.records if r.round == i] for i in range(len(rounds))
            ]
            medians = [float(np.median(v)) if v else np.nan for v in per_round]
            (line,) = ax.plot(rounds, medians, marker="o", label=run.label)
            xs = [r.round + 1 for r in run.records]
            ax.scatter(
                xs, [1000 * r.ttft_s for r in run.records], s=10, alpha=0.35, color=line.get_color()
            )
        ax.set_xlabel("round")
        ax.set_ylabel("time to first token (ms)")
        ax.set_xticks(rounds)
        ax.set_ylim(bottom=0)
        w = result.workload
        ax.set_title(
            f"kvtier demo: {w.users} users x {w.rounds} rounds, {result.model}", fontsize=9
        )
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        try:
            fig.savefig(path)
        except OSError as exc:
            raise InputError(f"cannot write the plot to {path!r}: {exc}") from exc
    finally:
        plt.close(fig)
