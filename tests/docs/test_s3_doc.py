"""docs/s3.md's SeaweedFS recipe is complete and safe: the identity file a reader copies, the
server bound to loopback with the flags the tests start it with, and the bucket command; run
as written (on free ports), it serves a signed put and get of a bucket it created."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.bench.seaweedfs import S3Credentials, SeaweedFS, free_ports, weed_binary
from kvtier.errors import TierError
from kvtier.storage.s3.client import S3Client

from .doc_blocks import block_after

DOC = "docs/s3.md"
HEADING = "**SeaweedFS.**"
# What the tests' own server (kvtier.bench.seaweedfs) binds and sets, and the doc must too.
SAFE_FLAGS = {"-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-master.telemetry=false", "-filer.maxMB=64"}


def _identity() -> Any:
    """The one identity of the doc's ``identities.json`` (parsed JSON: untyped)."""
    (identity,) = json.loads(block_after(DOC, HEADING, "json"))["identities"]
    return identity


def _server_command() -> list[str]:
    # as bash reads it: a backslash-newline continues the line (shlex would keep a "\n" word,
    # where weed's flag parsing stops)
    return shlex.split(block_after(DOC, HEADING, "bash").replace("\\\n", " "))


def _bucket_command() -> str:
    return block_after(DOC, "Last, from\nanother shell, the bucket", "bash").strip()


def _tests_command() -> tuple[list[str], Any]:
    """The command and identity file tests/s3_servers.py starts SeaweedFS with."""
    server = SeaweedFS()
    try:
        command = server._command()
        return command, json.loads((server.dir / "s3.json").read_text())
    finally:
        server.cleanup()


def test_the_identity_file_has_keys_and_the_actions_the_tests_grant() -> None:
    identity = _identity()
    (credentials,) = identity["credentials"]
    assert set(credentials) == {"accessKey", "secretKey"}
    (tests_identity,) = _tests_command()[1]["identities"]
    assert identity["actions"] == tests_identity["actions"]


def test_the_server_binds_loopback_with_the_tests_flags() -> None:
    command = _server_command()
    assert command[:2] == ["weed", "server"] and "-s3" in command
    assert set(command) >= SAFE_FLAGS, SAFE_FLAGS - set(command)
    assert set(_tests_command()[0]) >= SAFE_FLAGS  # the doc mirrors what the tests run
    assert "-s3.config=identities.json" in command and "-s3.port=8333" in command


def test_the_bucket_command_creates_the_bucket_the_config_names() -> None:
    assert _bucket_command() == (
        "echo 's3.bucket.create -name kv-cache' | weed shell -master=127.0.0.1:9333"
    )
    assert "`remote_url: s3://kv-cache/prod`" in " ".join(
        (Path(__file__).parents[2] / DOC).read_text().split()
    )


@pytest.fixture
def doc_server(tmp_path: Path) -> Iterator[tuple[str, int, Path]]:
    """The doc's ``weed server`` as written, in ``tmp_path``, with free ports appended (the
    last value of a repeated flag wins); stopped by its process group."""
    (tmp_path / "identities.json").write_text(block_after(DOC, HEADING, "json"))
    (tmp_path / "data").mkdir()
    master, s3, volume, filer, *grpc = free_ports(8)
    command = [weed_binary(), *_server_command()[1:]]
    command = [f"-dir={tmp_path / 'data'}" if a.startswith("-dir=") else a for a in command]
    command += [
        f"-master.port={master}",
        f"-s3.port={s3}",
        f"-volume.port={volume}",
        f"-filer.port={filer}",
        *(
            f"-{name}.port.grpc={port}"
            for name, port in zip(("master", "volume", "filer", "s3"), grpc, strict=True)
        ),
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-volume.preStopSeconds=0",
    ]
    with (tmp_path / "weed.log").open("wb") as log:
        proc = subprocess.Popen(
            command, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        # weed shell finds the master's gRPC port at 10000 above its own, or told "port.grpc"
        yield f"{master}.{grpc[0]}", s3, tmp_path
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@pytest.mark.slow
def test_the_recipe_as_written_serves_a_signed_put_and_get(
    doc_server: tuple[str, int, Path],
) -> None:
    master, s3, work = doc_server
    bucket = _bucket_command().replace("127.0.0.1:9333", f"127.0.0.1:{master}")
    bucket = bucket.replace("weed shell", f"{shlex.quote(weed_binary())} shell")
    (keys,) = _identity()["credentials"]
    credentials = S3Credentials(keys["accessKey"], keys["secretKey"])
    client = S3Client(
        f"http://127.0.0.1:{s3}",
        "kv-cache",
        {
            "access_key_id": credentials.access_key_id,
            "secret_access_key": credentials.secret_access_key,
            "region": credentials.region,
        },
        timeout_s=5.0,
    )
    deadline = time.monotonic() + 120  # ~4 s on the 2-core VM, far longer under load
    out = ""
    while "created bucket kv-cache" not in out:
        assert time.monotonic() < deadline, out + (work / "weed.log").read_text()[-2000:]
        try:  # weed shell waits for a master that is not up yet: bounded, then again
            result = subprocess.run(
                ["bash", "-c", bucket], capture_output=True, text=True, timeout=20, cwd=work
            )
            out = result.stdout + result.stderr
        except subprocess.TimeoutExpired:
            out = ""
        time.sleep(0.5)
    while True:  # the bucket's first write waits for a volume
        try:
            client.put("probe", b"kv")
            break
        except TierError:  # TierUnavailable included
            assert time.monotonic() < deadline, (work / "weed.log").read_text()[-2000:]
            time.sleep(0.5)
    assert bytes(client.get("probe") or b"") == b"kv"
