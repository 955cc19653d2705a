"""docs/fleet.md's two servers on one host: the block, run with bash as written (its socket
directories and ports moved to free ones), starts both servers, each on its own socket, P2P
port and admin ports, each following the other's address; a third server on a socket in use is
refused as the doc says."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtier.bench.seaweedfs import free_ports

from .doc_blocks import block_after, section

DOC = "docs/fleet.md"
HEADING = "## Two servers on one host"


def test_the_section_names_socket_p2p_and_admin_ports() -> None:
    text = " ".join(section(DOC, HEADING).split())
    for needed in ("its own `--socket`", "its own `p2p_listen` port", "its own admin ports"):
        assert needed in text
    assert "`something is already listening on PATH`" in text


def _wait_for(log: Path, pattern: str, proc: subprocess.Popen[bytes]) -> str:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        if re.search(pattern, text):
            return text
        assert proc.poll() is None, text
        time.sleep(0.2)
    raise AssertionError(f"{pattern!r} not in {log}: {log.read_text(errors='replace')}")


@pytest.mark.slow
def test_the_block_starts_two_servers_that_follow_each_other(tmp_path: Path) -> None:
    block = block_after(DOC, HEADING, "bash")
    p2p_a, p2p_b, admin_a, admin_b = free_ports(4)
    script = (
        block.replace("/tmp/kvtier-a", str(tmp_path / "kvtier-a"))
        .replace("/tmp/kvtier-b", str(tmp_path / "kvtier-b"))
        .replace("127.0.0.1:7700", f"127.0.0.1:{p2p_a}")
        .replace("127.0.0.1:7701", f"127.0.0.1:{p2p_b}")
        .replace("START=6999", f"START={admin_a}")
        .replace("START=7999", f"START={admin_b}")
        .replace("kvtier server --socket", "kvtier server --log-level INFO --socket")
    )
    script = re.sub(r"&\n", lambda _: f">> {tmp_path}/servers.log 2>&1 &\n", script) + "wait\n"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env.pop("KVTIER_CONFIG_FILE", None)
    log = tmp_path / "servers.log"
    log.touch()
    proc = subprocess.Popen(["bash", "-c", script], env=env, start_new_session=True)
    try:
        for name in ("kvtier-a", "kvtier-b"):
            _wait_for(log, rf"listening on unix://{re.escape(str(tmp_path / name))}/", proc)
        text = _wait_for(log, rf"http://127\.0\.0\.1:{admin_b}\+", proc)
        assert f"http://127.0.0.1:{admin_a}+" in text
        assert f"P2P listening on 127.0.0.1:{p2p_a}, following 1 peers" in text
        assert f"P2P listening on 127.0.0.1:{p2p_b}, following 1 peers" in text
        # A third on a socket in use: refused, naming it.
        third = subprocess.run(
            [sys.executable, "-m", "kvtier.cli.main", "server", "--socket"]
            + [str(tmp_path / "kvtier-a" / "kvtier.sock")],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert third.returncode != 0
        assert f"something is already listening on {tmp_path}/kvtier-a/kvtier.sock" in third.stderr
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the servers drain and exit
        proc.wait(30)
