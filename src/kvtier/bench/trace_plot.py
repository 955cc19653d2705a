"""``kvtier bench trace --plot FILE``: the hit ratio by capacity of the replay's ``curve``, one
line per cache (kvtier's CPU tier, the offline optimum, LRU, ARC, LRU storing whole blocks
only), the infinite cache as a ceiling. A PNG (matplotlib, in the ``demo`` extra)."""

from __future__ import annotations

from typing import Any

from kvtier.errors import InputError

LINES = (
    ("cpu", "kvtier CPU tier", "o-"),
    ("opt", "offline optimum", "k--"),
    ("lru", "LRU", "s:"),
    ("arc", "ARC", "^:"),
    ("lru_whole", "LRU, whole blocks", "v:"),
)


def write_plot(result: dict[str, Any], path: str) -> None:
    """The curve of a ``kvtier.bench.trace.run`` result, written to ``path`` (Agg)."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise InputError(
            "--plot needs matplotlib: pip install 'kvtier[demo]' (or matplotlib)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve: dict[str, dict[str, float]] = result["curve"]
    xs = sorted(curve, key=float)
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    try:
        for key, label, style in LINES:
            ax.plot([100 * float(x) for x in xs], [curve[x][key] for x in xs], style, label=label)
        ax.axhline(result["inf_hit_ratio"], color="grey", linewidth=0.8, label="infinite cache")
        ax.set_xscale("log")
        ax.set_xlabel("capacity, % of the trace's unique blocks")
        ax.set_ylabel("token hit ratio")
        ax.set_title(f"{result['trace']}: policy {result['policy']}, {result['requests']} requests")
        ax.legend()
        fig.tight_layout()
        try:
            fig.savefig(path)
        except OSError as exc:
            raise InputError(f"--plot {path}: cannot write it ({exc.strerror})") from None
    finally:
        plt.close(fig)
