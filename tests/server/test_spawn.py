"""A ``kvtier server`` that a bench or a test starts dies with its parent (kvtier.server.spawn).

Each spawner runs in a parent process of its own, as a bench does; the parent is then killed
with SIGKILL (a timeout's kill: no ``finally`` of the parent runs), and the server must be gone
within a few seconds. Every place that starts a server this way is checked: ``kvtier bench
server``, ``python -m benchmarks serve`` and the tests' own :class:`ServerProcess`.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.server_helpers import SRC, remove_tempdir, short_tempdir

ROOT = Path(__file__).resolve().parents[2]
GONE_WITHIN_S = 10.0  # the server's drain on SIGTERM, on a loaded machine
STARTED_WITHIN_S = 180.0  # two imports of torch, on a loaded machine

# Each starts a server on the socket in DIR and leaves its Popen in `proc`.
SPAWNERS = {
    "kvtier-bench-server": (
        "from kvtier.bench.server import _start_server\n"
        "from kvtier.config import Config\n"
        "config = Config.load(env={}, overrides={'max_local_cpu_size': '1MiB'})\n"
        "proc = _start_server(f'unix://{DIR}/kvtier.sock', config)\n"
    ),
    "benchmarks-serve": (
        "from pathlib import Path\n"
        "from benchmarks.serving import KVTierServer\n"
        "proc = KVTierServer(f'{DIR}/kvtier.sock', '1MiB', Path(DIR)).proc\n"
    ),
    "tests-server-process": (
        "from tests.server.server_helpers import ServerProcess\n"
        "proc = ServerProcess(DIR, max_local_cpu_size='1MiB').start().proc\n"
    ),
}


def alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie nobody reaped yet has ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture
def directory() -> Iterator[str]:
    path = short_tempdir()
    yield path
    remove_tempdir(path)


@pytest.mark.slow  # two imports of torch per spawner: about 15 s each on 2 cores
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG)")
@pytest.mark.parametrize("spawner", sorted(SPAWNERS))
def test_a_server_dies_with_the_bench_that_started_it(spawner: str, directory: str) -> None:
    script = f"DIR = {directory!r}\n{SPAWNERS[spawner]}print(proc.pid, flush=True)\n"
    script += "import time\ntime.sleep(600)\n"  # the bench goes on until it is killed
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVTIER_", "LMCACHE_"))}
    env["PYTHONPATH"] = os.pathsep.join([SRC, str(ROOT), env.get("PYTHONPATH", "")])
    parent = subprocess.Popen(
        [sys.executable, "-c", script], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True
    )
    server = 0
    try:
        assert parent.stdout is not None
        ready, _, _ = select.select([parent.stdout], [], [], STARTED_WITHIN_S)
        line = parent.stdout.readline() if ready else ""  # the pid, once the server listens
        assert line.strip().isdigit(), f"{spawner} did not start a server (exit {parent.poll()})"
        server = int(line)
        assert alive(server)
        parent.kill()  # SIGKILL, as a timeout does: nothing of the parent's runs after it
        parent.wait(30)
        deadline = time.monotonic() + GONE_WITHIN_S
        while alive(server) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(server), (
            f"the server {spawner} started (pid {server}) outlived its killed parent by "
            f"{GONE_WITHIN_S:g}s"
        )
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(30)
        if server and alive(server):
            os.kill(server, signal.SIGKILL)
