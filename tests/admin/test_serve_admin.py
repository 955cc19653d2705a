"""``kvtier serve-admin``: a real process serving the dashboard over a synthetic workload."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from kvtier.cli.main import main
from tests.admin.client import call

COMMAND = [sys.executable, "-m", "kvtier.cli.main", "serve-admin"]


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve-admin", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--port", "--token", "--duration", "--rate", "--no-workload"):
        assert flag in out


def test_serves_a_live_workload_then_exits_cleanly() -> None:
    proc = subprocess.Popen(
        [
            *COMMAND,
            "--port",
            "0",
            "--duration",
            "4",
            "--rate",
            "40",
            "--cpu-size",
            "8MiB",
            "--token",
            "cli-token",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert first.startswith("dashboard: http://127.0.0.1:"), first
        base = first.split()[1].split("/?")[0].rstrip("/")
        assert call(base, "/stats").status == 401
        deadline = time.monotonic() + 30
        stats: dict[str, object] = {}
        while time.monotonic() < deadline:
            stats = call(base, "/stats", token="cli-token").json()
            if stats["lookups"] >= 10 and stats["hit_tokens"] > 0:  # type: ignore[operator]
                break
            time.sleep(0.1)
        assert stats["lookups"] >= 10, stats  # type: ignore[operator]
        assert stats["hit_tokens"] > 0  # type: ignore[operator]  # turns reuse their prefix
        assert stats["observability"]["ttft"]["reported_requests"] > 0  # type: ignore[index]
        assert proc.wait(timeout=60) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
