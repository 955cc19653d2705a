"""A real ``kvtier server`` process for tests, and clients that talk to it.

The server runs as ``python -m kvtier.cli.main server`` (the command users run), its config
from the environment, its log in a file the test can read. Socket paths live in a short
directory under /tmp: a Unix socket path is limited to 107 bytes, and pytest's tmp_path can
be longer than that.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

from kvtier import Config, KVLayout
from kvtier.server.client import ServerClient
from kvtier.server.daemon import KVTierServer
from kvtier.server.spawn import spawn_server
from tests.conftest import SMALL_CHUNK, SMALL_LAYOUT
from tests.hosts import needs_root

SRC = str(Path(__file__).resolve().parents[2] / "src")
CHUNK_BYTES = SMALL_LAYOUT.chunk_bytes(SMALL_CHUNK)
NOBODY = 65534  # another local user
# How another local user takes a path first; all but our own loose directory need root to make
# (an entry owned by uid 65534): tests/hosts.py's rule.
SQUATS = [
    pytest.param(how, marks=() if how == "ours-0777" else needs_root)
    for how in ("nobody-0700", "nobody-0777", "ours-0777", "file", "symlink")
]


class ServerProcess:
    """``kvtier server`` in a child process. ``config``: KVTIER_<KEY> environment values."""

    def __init__(self, directory: str, **config: object) -> None:
        self.directory = directory
        self.path = os.path.join(directory, "kvtier.sock")
        self.url = f"unix://{self.path}"
        self.log_path = os.path.join(directory, f"server-{time.monotonic_ns()}.log")
        self.env = {
            k: v for k, v in os.environ.items() if not k.startswith(("KVTIER_", "LMCACHE_"))
        }
        self.env["PYTHONPATH"] = SRC + os.pathsep + self.env.get("PYTHONPATH", "")
        self.env.update({f"KVTIER_{k.upper()}": str(v) for k, v in config.items()})
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> ServerProcess:
        with open(self.log_path, "wb") as log:
            # A child that dies with the test run: a run killed by a timeout leaves no server.
            self.proc = spawn_server(self.path, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not self._answers():
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"server not listening after {timeout} s:\n{self.log()}")
            time.sleep(0.05)
        return self

    def _answers(self) -> bool:
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(self.path)
            return True
        except OSError:
            return False
        finally:
            probe.close()

    def log(self) -> str:
        return Path(self.log_path).read_text(errors="replace")

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM (drain), and the exit status."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        """SIGKILL: no drain, no cleanup (the socket file stays behind)."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


class InProcess:
    """A KVTierServer serving on a thread of this process (16 pages unless told)."""

    def __init__(self, directory: str, **overrides: object) -> None:
        self.path = os.path.join(directory, "kvtier.sock")
        self.url = f"unix://{self.path}"
        values: dict[str, object] = {"max_local_cpu_size": f"{16 * CHUNK_BYTES}B"}
        values.update(overrides)
        self.server = KVTierServer(Config.load(overrides=values, env={}), self.path).open()
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.stop()
        self.thread.join(10)
        self.server.close()


def short_tempdir() -> str:
    return tempfile.mkdtemp(prefix="kvs-", dir="/tmp")


def remove_tempdir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def client_config(**overrides: object) -> Config:
    values: dict[str, object] = {"chunk_size": SMALL_CHUNK, "blocking_timeout_secs": 10.0}
    values.update(overrides)
    return Config.load(overrides=values, env={})


def open_client(
    url: str,
    layout: KVLayout = SMALL_LAYOUT,
    model_name: str = "test-model",
    max_backoff: float = 0.2,
    **overrides: object,
) -> ServerClient:
    client = ServerClient(
        url,
        layout,
        model_name=model_name,
        config=client_config(**overrides),
        max_backoff=max_backoff,
    )
    return client.open()


def wait_until(condition: object, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def idle_server_state(client: ServerClient) -> dict[str, object]:
    """What a server with no request open must look like for this client's model."""
    stats = client.stats()
    assert stats["connected"], "the checking client is not connected"
    return {
        "open_requests": stats["open_requests"],
        "pinned_pages": stats["pinned_pages"],
        "pages_used_minus_cached": stats["allocator"]["pages_used"]
        - stats["tiers"]["cpu"]["entries"],
        "problems": client.check_invariants(),
    }


IDLE = {"open_requests": 0, "pinned_pages": 0, "pages_used_minus_cached": 0, "problems": []}


def zeros_like_kv(num_tokens: int) -> torch.Tensor:
    return torch.zeros(SMALL_LAYOUT.kv_shape(num_tokens), dtype=SMALL_LAYOUT.dtype)


def squat(path: str, how: str) -> None:
    """Take ``path`` first, as another local user can in a shared $TMPDIR."""
    if how == "file":
        with open(path, "w") as f:
            f.write("mine")
        os.chown(path, NOBODY, -1)
    elif how == "symlink":  # to a directory the squatter owns
        target = path + "-target"
        os.mkdir(target, 0o700)
        os.chown(target, NOBODY, -1)
        os.symlink(target, path)
    else:
        mode, owner = {"nobody-0700": (0o700, NOBODY), "nobody-0777": (0o777, NOBODY)}.get(
            how, (0o777, os.geteuid())
        )
        os.mkdir(path)
        os.chmod(path, mode)
        os.chown(path, owner, -1)


def identity(info: os.stat_result) -> tuple[int, int, int]:
    """What a squatter's entry is: owner, mode and inode (replaced or chmod-ed shows)."""
    return info.st_uid, info.st_mode, info.st_ino
