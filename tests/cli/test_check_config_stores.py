"""``kvtier check-config`` tries the S3 bucket, the P2P peers and the machine's memory a config
names, and fails naming each broken one in a line of its own, all in one run, within its
promised time (issue 58, item 2). Real servers: SeaweedFS for S3, a real P2P node as the peer.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.bench.seaweedfs import SeaweedFS
from kvtier.cli.config_probes import NETWORK_TIMEOUT_S, machine_memory, probe_all
from kvtier.config import Config
from kvtier.config.sizes import format_size
from kvtier.p2p.node import P2PNode
from kvtier.storage.s3.client import S3Client
from tests.cli.test_check_config import TINY, check
from tests.cli.test_config_probes import SLACK_S, SilentNode
from tests.redis_servers import free_port

TOKEN = "the-fleet-token-0123456789"
PROBE_S = 5.0  # blocking_timeout_secs: above NETWORK_TIMEOUT_S, so that one is the bound


@pytest.fixture
def peer() -> Iterator[P2PNode]:
    node = P2PNode("127.0.0.1:0", [], token=TOKEN, lease_secs=5, timeout=2).open()
    try:
        yield node
    finally:
        node.close()


def s3_lines(
    server: SeaweedFS, bucket: str, *, endpoint: str | None = None, secret: str | None = None
) -> str:
    creds = server.credentials
    return (
        f"remote_url: {server.url(bucket)}\n"
        "extra_config:\n"
        f"  s3_endpoint_url: {endpoint or server.endpoint}\n"
        f"  aws_access_key_id: {creds.access_key_id}\n"
        f"  aws_secret_access_key: '{secret or creds.secret_access_key}'\n"
        f"blocking_timeout_secs: {PROBE_S}\n"
    )


def p2p_lines(*peers: str, token: str = TOKEN) -> str:
    listen = f"127.0.0.1:{free_port()}"  # this server's own, not started
    return f"p2p_listen: '{listen}'\np2p_peers: {json.dumps([listen, *peers])}\n" + (
        f"p2p_auth_token: {token}\n"
    )


def errors_of(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("kvtier: error:")]


def test_a_working_bucket_and_peer_pass_and_leave_nothing_behind(
    tmp_path: Path, seaweedfs: SeaweedFS, bucket: str, peer: P2PNode
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(s3_lines(seaweedfs, bucket) + p2p_lines(peer.address))
    result = check(path, *TINY, "--json")
    assert result.returncode == 0, result.stderr
    checked = json.loads(result.stdout)["checked"]
    assert f"remote_url: list+put+delete in s3://{bucket}/kv at {seaweedfs.endpoint}: ok" in (
        checked
    )
    assert f"p2p_peers: handshake with {peer.address}: ok" in checked
    assert not any(
        "127.0.0.1:" in c and "handshake" in c and peer.address not in c for c in checked
    )
    client = S3Client(seaweedfs.endpoint, bucket, seaweedfs.credentials_dict(), timeout_s=5)
    assert list(client.list("kv")) == []  # the probe object is gone


@pytest.mark.parametrize(
    ("broken", "fragment"),
    [
        ("bucket", "list failed: HTTP 404 NoSuchBucket"),
        ("secret", "list failed: HTTP 403 SignatureDoesNotMatch"),
        ("endpoint", "list failed: nothing answered"),
    ],
)
def test_a_broken_s3_setup_is_named_with_bucket_endpoint_and_code(
    tmp_path: Path, seaweedfs: SeaweedFS, bucket: str, broken: str, fragment: str
) -> None:
    endpoint = f"http://127.0.0.1:{free_port()}" if broken == "endpoint" else seaweedfs.endpoint
    name = "kvtier-no-such-bucket" if broken == "bucket" else bucket
    secret = "x" * 40 if broken == "secret" else None
    path = tmp_path / "c.yaml"
    path.write_text(s3_lines(seaweedfs, name, endpoint=endpoint, secret=secret))
    result = check(path, *TINY)
    assert result.returncode == 2
    (line,) = errors_of(result.stderr)
    assert f"'remote_url' has invalid value \"bucket '{name}' at {endpoint}\"" in line, line
    assert fragment in line, line
    assert "x" * 40 not in result.stderr + result.stdout
    assert seaweedfs.credentials.secret_access_key not in result.stderr + result.stdout


def test_a_dead_peer_and_a_wrong_token_are_named(tmp_path: Path, peer: P2PNode) -> None:
    dead = f"127.0.0.1:{free_port()}"
    path = tmp_path / "c.yaml"
    path.write_text(p2p_lines(dead, peer.address, token="another-token-0123456789"))
    result = check(path, *TINY)
    assert result.returncode == 2
    errors = errors_of(result.stderr)
    assert len(errors) == 2, result.stderr
    assert f"'p2p_peers' has invalid value '{dead}'" in errors[0]
    assert "nothing listens there" in errors[0]
    assert f"'p2p_peers' has invalid value '{peer.address}'" in errors[1]
    assert "the token is refused" in errors[1] and "p2p_auth_token differs" in errors[1]
    assert "another-token" not in result.stderr  # the token is never shown


def test_a_cpu_size_above_the_machines_memory_is_named_with_the_total(tmp_path: Path) -> None:
    total, _ = machine_memory()
    assert total is not None
    gib = total // 1024**3 + 8  # docs/fleet.md's 32GiB on a 24 GiB host, whatever this one has
    path = tmp_path / "c.yaml"
    path.write_text(f"max_local_cpu_size: {gib}GiB\n")
    result = check(path, *TINY)
    assert result.returncode == 2
    (line,) = errors_of(result.stderr)
    assert f"'max_local_cpu_size' has invalid value '{gib}.00 GiB'" in line, line
    assert f"at most this machine's memory: {format_size(total)} in all" in line, line


def test_every_broken_store_in_one_run_within_the_promised_time(
    tmp_path: Path, seaweedfs: SeaweedFS, bucket: str, peer: P2PNode
) -> None:
    """A wrong S3 secret, a dead peer, a wrong peer token and too much memory: four lines."""
    total, _ = machine_memory()
    assert total is not None
    dead = f"127.0.0.1:{free_port()}"
    path = tmp_path / "c.yaml"
    path.write_text(
        s3_lines(seaweedfs, bucket, secret="y" * 40)
        + p2p_lines(dead, peer.address, token="another-token-0123456789")
        + f"max_local_cpu_size: {total // 1024**3 + 8}GiB\n"
    )
    started = time.monotonic()
    result = check(path, *TINY)
    elapsed = time.monotonic() - started
    assert result.returncode == 2
    errors = errors_of(result.stderr)
    assert len(errors) == 4, result.stderr
    assert "4 problem(s)" in result.stderr
    for fragment in ("SignatureDoesNotMatch", "nothing listens there", "token is refused"):
        assert sum(fragment in e for e in errors) == 1, fragment
    assert sum("max_local_cpu_size" in e for e in errors) == 1
    assert elapsed < NETWORK_TIMEOUT_S + 10, elapsed  # interpreter start on a loaded host


@pytest.fixture
def silent() -> Iterator[list[SilentNode]]:
    nodes = [SilentNode() for _ in range(3)]
    try:
        yield nodes
    finally:
        for node in nodes:
            node.close()


def test_silent_s3_and_peers_end_the_probes_at_one_deadline(silent: list[SilentNode]) -> None:
    """A store and peers that accept and never answer: all waited on at once, so the run is
    over within NETWORK_TIMEOUT_S, not one timeout per store, per step or per peer."""
    s3, *peers = silent
    config = Config.load(
        overrides={
            "remote_url": "s3://kv-bucket/kv",
            "extra_config": {
                "s3_endpoint_url": f"http://127.0.0.1:{s3.port}",
                "aws_access_key_id": "id",
                "aws_secret_access_key": "secret",
            },
            "blocking_timeout_secs": 30,
            "p2p_listen": f"127.0.0.1:{free_port()}",
            "p2p_peers": [f"127.0.0.1:{p.port}" for p in peers],
            "p2p_auth_token": TOKEN,
        },
        env={},
    )
    started = time.monotonic()
    found = probe_all(config)
    elapsed = time.monotonic() - started
    assert elapsed < NETWORK_TIMEOUT_S + SLACK_S + 0.5, elapsed
    errors = [str(error) for _, error in found if error is not None]
    assert len(errors) == 3, errors
    assert any(f"127.0.0.1:{s3.port}" in e and "no answer within" in e for e in errors), errors
    for node in peers:
        assert any(f"127.0.0.1:{node.port}" in e and "no answer" in e for e in errors), errors
