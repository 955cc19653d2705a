"""vllm-router as a real process for the PD tests (tests/cli/test_pd_proxy.py,
tests/integrations/vllm/test_pd_router.py): started in its own process group, ready once it
answers on its port, stopped with the group."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROUTER = str(Path(sys.executable).parent / "vllm-router")


def pd_command(prefill: str, decode: str, port: int, metrics_port: int) -> list[str]:
    """The router in PD mode as docs/vllm.md runs it, on loopback ports of the test's."""
    return [
        ROUTER,
        "--vllm-pd-disaggregation",
        "--prefill",
        prefill,
        "--decode",
        decode,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-port",
        str(metrics_port),
        "--worker-startup-check-interval",
        "1",
    ]


class RouterProcess:
    """``command`` (vllm-router, or a command that execs it) serving on ``port``."""

    def __init__(self, command: list[str], port: int, log: Path, **env: str) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env},
                start_new_session=True,
            )

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Until the router answers /v1/models (it listens once its workers are healthy)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=5):
                    return
            except urllib.error.HTTPError:
                return  # it answers
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log.read_text(errors="replace")[-4000:]
                raise RuntimeError(f"vllm-router did not come up; log:\n{tail}")
            time.sleep(0.3)

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
