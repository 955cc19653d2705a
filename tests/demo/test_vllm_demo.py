"""``kvtier demo --engine vllm`` end to end: three real vLLM instances, one table, one plot.

One small run of the command (each configuration starts its own vLLM, ~20 s apiece on 2
cores): same greedy tokens everywhere (exit code 0), kvtier's CPU tier hits, and the
restarted vLLM finds the conversations on disk.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvtier.cli.main import main

# Prompts of 800-848 tokens: 3 whole 256-token chunks from round 1 on.
SMALL = [
    "--users", "2", "--rounds", "2", "--system-tokens", "256", "--context-tokens", "512",
    "--question-tokens", "32", "--answer-tokens", "8", "--chunk-size", "256",
]  # fmt: skip


def _row(table: str, label: str) -> str:
    (line,) = [line for line in table.splitlines() if line.startswith(label)]
    return line


def _hit_rate(row: str) -> int:
    match = re.search(r"(\d+)%", row)
    assert match is not None, row
    return int(match.group(1))


def test_vllm_demo_same_tokens_cpu_and_disk_hits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plot = tmp_path / "demo.png"
    code = main(["demo", "--engine", "vllm", "--no-progress", "--plot", str(plot), *SMALL])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "tokens: identical in every configuration" in out
    assert "leases: none left open" in out
    baseline = _row(out, "no kvtier (vLLM prefix cache off)")  # the baseline says what it is
    assert "vLLM's own prefix cache is off in every configuration, the baseline included" in out
    cpu = _row(out, "kvtier CPU tier (+ disk write-through)")
    restart = _row(out, "restart: cold CPU, warm disk")
    assert _hit_rate(baseline) == 0
    assert _hit_rate(cpu) > 0 and "hits from cpu" in cpu
    # Every request of the restarted vLLM reuses at least its round-1 prefix (768 of at most
    # 848 tokens); user 1's round 1 reads all of it from disk (the shared system chunk is in
    # the CPU tier again by user 2's turn).
    assert _hit_rate(restart) >= 90
    disk = re.search(r"hits from disk (\d+)", restart)
    assert disk is not None and int(disk.group(1)) >= 768, restart
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_vllm_demo_refuses_the_dashboard(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--engine", "vllm", "--dashboard", *SMALL]) == 2
    assert "--dashboard works with --engine transformers only" in capsys.readouterr().err
