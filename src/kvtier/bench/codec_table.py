"""``kvtier bench codec``'s text output: the table docs/codecs.md shows (one row per dtype's
memcpy and per codec), with the quality gate's verdict beside each lossy codec when it ran.
``--json`` prints the whole result instead."""

from __future__ import annotations

from typing import Any

HEADER = (
    "| dtype | codec | ratio | encode GB/s | decode GB/s | rel. error K / V | quality gate |",
    "|---|---|---|---|---|---|---|",
)


def format_text(result: dict[str, Any]) -> str:
    """The Markdown table of a ``kvtier.bench.codec.run`` result."""
    rows = list(HEADER)
    for label, section in result.items():
        if not isinstance(section, dict) or "codecs" not in section:
            continue  # threads, tokens
        rows.append(f"| {label} | memcpy | | {section['memcpy_gbps']:.2f} | | | |")
        for name, row in section["codecs"].items():
            encode = "(a view)" if row["encode_gbps"] is None else f"{row['encode_gbps']:.2f}"
            rows.append(
                f"| | {name} | {row['ratio']:.2f} | {encode} | {row['decode_gbps']:.2f} "
                f"| {_error(row)} | {_gate(row.get('gate'))} |"
            )
    threads, tokens = result.get("threads"), result.get("tokens")
    rows.append(f"\n{threads} thread, {tokens}-token chunks; GB/s of payload")
    return "\n".join(rows)


def _error(row: dict[str, Any]) -> str:
    if row["encode_gbps"] is None:  # identity: the page itself, nothing to compare
        return ""
    if row["lossless"]:
        return "exact"
    key, value = row.get("key_rel_error"), row.get("value_rel_error")
    shown = [f"{100 * e:.2f} %" for e in (key, value) if e is not None]
    return " / ".join(shown)


def _gate(gate: dict[str, Any] | None) -> str:
    if not gate:
        return ""
    verdict = "pass" if gate["passed"] else "FAIL"
    return (
        f"{verdict}: agreement {gate['greedy_agreement']:.4f}, accuracy "
        f"{gate['accuracy']:.3f} (recompute {gate['recompute_accuracy']:.3f})"
    )
