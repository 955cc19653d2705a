"""``kvtier bench trace`` says what it is doing on stderr and draws its curve with --plot
(issue 50, item 9: 45-105 s without a line)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.bench.test_trace import random_requests, write_trace

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_progress_on_stderr_the_result_alone_on_stdout_and_the_plot(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", random_requests(3, 300))
    png = tmp_path / "curve.png"
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    result = subprocess.run(
        [
            sys.executable, "-m", "kvtier.cli.main", "bench", "trace", str(path),
            "--block-tokens", "4", "--capacity", "0.03", "--plot", str(png), "--json",
        ],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)  # stdout is the result alone
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("bench trace: ")]
    # a first line at once, one per capacity (0.03 and the curve's six), the last search
    assert lines[0].startswith("bench trace: 300 requests") and "7 capacities" in lines[0]
    assert sum(": cpu " in ln for ln in lines) == 7
    assert data["plot"] == str(png)
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 10_000
