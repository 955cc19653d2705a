"""The server's admin API and Prometheus metrics: per model, behind the admin token."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

from tests.conftest import make_kv, make_tokens
from tests.server.server_helpers import ServerProcess, open_client, remove_tempdir, short_tempdir


def get(url: str, token: str | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""


def test_admin_api_and_metrics_of_a_served_model() -> None:
    directory = short_tempdir()
    proc = ServerProcess(
        directory,
        max_local_cpu_size="1MiB",
        internal_api_server_enabled="true",
        internal_api_server_port_start=0,
        admin_token="s3cret",
    ).start()
    try:
        with open_client(proc.url) as client:
            tokens = make_tokens(64, 3)
            client.store(tokens, make_kv(64, 3))
            assert client.lookup(tokens, "seen-by-admin").tokens == 64
            admin = client.stats()["server"]["admin_url"]
            assert admin and admin.startswith("http://127.0.0.1:")
            assert get(f"{admin}/health")[0] == 200
            assert get(f"{admin}/metrics")[0] == 401  # the token is still required
            status, metrics = get(f"{admin}/metrics", "s3cret")
            assert status == 200 and "kvtier_" in metrics
            status, leases = get(f"{admin}/leases", "s3cret")
            assert status == 200 and "seen-by-admin" in leases  # the client's lease, named
            client.end_request("seen-by-admin")
    finally:
        proc.stop()
        remove_tempdir(directory)


def test_the_server_says_listening_once_with_the_admin_api_at_start() -> None:
    directory = short_tempdir()
    proc = ServerProcess(
        directory, max_local_cpu_size="1MiB", internal_api_server_enabled="true"
    ).start()
    try:
        deadline = time.monotonic() + 10  # the socket answers a moment before the line
        while "listening" not in proc.log() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # a second line, if any, would come right after
        lines = [line for line in proc.log().splitlines() if "listening" in line]
        assert len(lines) == 1, proc.log()
        assert f"unix://{proc.path}" in lines[0]
        assert "admin API" in lines[0] and "http://127.0.0.1:6999" in lines[0]  # no client yet
    finally:
        proc.stop()
        remove_tempdir(directory)
