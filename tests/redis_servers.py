"""Real redis-server processes for tests: a single server and a 3-master cluster.

Each server runs on a free loopback port with persistence off (``--save '' --appendonly no``)
in its own temporary directory, and is stopped by PID. Fixtures own them and stop them in
their finalizers, so a failed test never leaves a server behind.

Fault helpers act on the real process: :meth:`RedisServer.kill` (SIGKILL, the server dies
mid-run), :meth:`RedisServer.pause` / :meth:`RedisServer.resume` (SIGSTOP/SIGCONT, the server
stalls: connections stay open but nothing answers) and :meth:`RedisServer.restart` (same
port, empty data).

A missing ``redis-server`` or ``redis-cli`` is a test *failure* with a clear message, never a
skip: ``make system-deps`` (scripts/install-system-deps.sh) installs both.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
from pathlib import Path

import redis

from tests.waiting import wait_until

START_TIMEOUT_S = 15.0
PORT_RETRIES = 5
INSTALL_HINT = "run `make system-deps` (installs Debian's redis-server and redis-tools)"


class PortTaken(RuntimeError):
    """redis-server exited because its port was bound by someone else first."""


def require_binary(name: str) -> str:
    """The path of ``name`` on PATH; raises with an install hint when it is missing."""
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"{name} is not installed or not on PATH: {INSTALL_HINT}")
    return path


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(*, cluster_bus: bool = False) -> int:
    """A loopback port nobody listens on (and, for cluster nodes, port + 10000 too)."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 55000)
        if _port_is_free(port) and (not cluster_bus or _port_is_free(port + 10000)):
            return port
    raise RuntimeError("no free loopback port found")


class RedisServer:
    """One redis-server process on 127.0.0.1:``port``."""

    def __init__(self, *, cluster: bool = False, extra_args: tuple[str, ...] = ()) -> None:
        self.binary = require_binary("redis-server")
        self.cluster = cluster
        self.extra_args = extra_args
        self.port = free_port(cluster_bus=cluster)
        self.dir = Path(tempfile.mkdtemp(prefix="kvtier-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_once = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def client(self, timeout: float = 5.0) -> redis.Redis:
        """A raw redis-py client (for injecting faults and checking what the tier wrote)."""
        return redis.Redis(
            host="127.0.0.1", port=self.port, socket_timeout=timeout, socket_connect_timeout=timeout
        )

    def _command(self) -> list[str]:
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "no",
            "--dir",
            str(self.dir),
            "--logfile",
            str(self.dir / "redis.log"),
        ]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
            args += ["--cluster-node-timeout", "5000"]
        return args + list(self.extra_args)

    def start(self) -> RedisServer:
        """Start and wait for PING. The port was only free when picked: if another process
        (another xdist worker's server) took it since, start again on a newly picked one, the
        first start only (a restart keeps its port: its clients know it)."""
        assert self.proc is None, "server already running"
        for _ in range(PORT_RETRIES):
            (self.dir / "redis.log").unlink(missing_ok=True)
            self.proc = subprocess.Popen(
                self._command(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            try:
                wait_until(self.answers_ping, START_TIMEOUT_S, f"redis-server on port {self.port}")
            except PortTaken:
                self.proc = None
                if self.started_once:
                    raise
                self.port = free_port(cluster_bus=self.cluster)
                continue
            except TimeoutError:
                self.stop()
                raise
            self.started_once = True
            return self
        raise RuntimeError(f"redis-server found its port taken {PORT_RETRIES} times in a row")

    def answers_ping(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            log = (self.dir / "redis.log").read_text(errors="replace")[-2000:]
            if "Address already in use" in log:
                raise PortTaken(f"port {self.port} was taken before redis-server bound it")
            raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {log}")
        try:
            with self.client(timeout=0.5) as client:
                return bool(client.ping())
        except redis.RedisError:
            return False

    def kill(self) -> None:
        """SIGKILL: the server dies mid-run, with no goodbye to its clients."""
        self.resume()
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    def stop(self) -> None:
        """SIGTERM, then SIGKILL when it does not exit in time. Idempotent."""
        if self.proc is None:
            return
        self.resume()
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None

    def restart(self) -> None:
        """Start again on the same port (with empty data: persistence is off)."""
        self.stop()
        self.start()

    def pause(self) -> None:
        """SIGSTOP: the server stalls; its sockets stay open but nothing answers."""
        if self.proc is not None:
            os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class RedisClusterServers:
    """Three cluster-enabled masters joined by ``redis-cli --cluster create`` (no replicas)."""

    def __init__(self, masters: int = 3) -> None:
        self.cli = require_binary("redis-cli")
        self.nodes = [RedisServer(cluster=True) for _ in range(masters)]

    @property
    def url(self) -> str:
        return "redis-cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self) -> RedisClusterServers:
        try:
            for node in self.nodes:
                node.start()
            addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
            subprocess.run(
                [self.cli, "--cluster", "create", *addresses]
                + ["--cluster-replicas", "0", "--cluster-yes"],
                check=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                timeout=60,
            )
            wait_until(self.all_ok, 30, "cluster_state:ok on every node")
        except BaseException:
            self.cleanup()
            raise
        return self

    def all_ok(self) -> bool:
        for node in self.nodes:
            try:
                with node.client(timeout=1.0) as client:
                    info = client.execute_command("CLUSTER", "INFO")
            except redis.RedisError:
                return False
            text = info.decode() if isinstance(info, bytes) else str(info)
            if "cluster_state:ok" not in text:
                return False
        return True

    def node_holding(self, key: bytes | str) -> RedisServer:
        """The master whose slot range holds ``key``."""
        with self.nodes[0].client() as client:
            slot = int(client.execute_command("CLUSTER", "KEYSLOT", key))
            for start, end, master, *_ in client.execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    port = int(master[1])
                    return next(n for n in self.nodes if n.port == port)
        raise AssertionError(f"no master serves slot {slot}")

    def cleanup(self) -> None:
        for node in self.nodes:
            node.cleanup()


def make_tls_files(directory: Path) -> dict[str, Path]:
    """A throwaway CA and a server certificate for 127.0.0.1 signed by it (openssl CLI)."""
    openssl = require_binary("openssl")
    files = {name: directory / f"{name}.pem" for name in ("ca", "ca_key", "cert", "key")}
    ext = directory / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    steps = [
        ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=kvtier-ca"]
        + ["-keyout", str(files["ca_key"]), "-out", str(files["ca"])],
        ["req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1"]
        + ["-keyout", str(files["key"]), "-out", str(directory / "server.csr")],
        ["x509", "-req", "-in", str(directory / "server.csr"), "-CA", str(files["ca"])]
        + ["-CAkey", str(files["ca_key"]), "-CAcreateserial", "-days", "1"]
        + ["-extfile", str(ext), "-out", str(files["cert"])],
    ]
    for step in steps:
        subprocess.run([openssl, *step], check=True, capture_output=True, timeout=60)
    return files
