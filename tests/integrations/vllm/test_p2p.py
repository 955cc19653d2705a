"""A P2P hit across two hosts' ``kvtier server``s, through vLLM.

Two servers on loopback, each with its own socket directory and P2P port, following each
other (``p2p_peers``). A vLLM instance on server A stores its prompts and shuts down; a
fresh vLLM on server B (its own prefix cache empty, B's CPU tier empty) finds them in B's
directory, pulls them from A, and its greedy outputs (fp32) equal vLLM's with no connector.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.config import Config
from kvtier.server.client import ServerClient
from tests.server.server_helpers import ServerProcess, remove_tempdir, short_tempdir, wait_until

from .conftest import PROMPTS
from .test_vllm_server import CHUNK, EXPECTED_HITS, FIRST, LAYOUT, SECOND, _instance
from .vllm_helpers import Instances

pytestmark = pytest.mark.slow

TOKEN = "a-fleet-secret-of-32-characters!"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def two_hosts() -> Iterator[tuple[ServerProcess, ServerProcess]]:
    ports = [_free_port(), _free_port()]
    dirs = [short_tempdir(), short_tempdir()]
    peers = ",".join(f"127.0.0.1:{p}" for p in ports)
    procs = [
        ServerProcess(
            d,
            max_local_cpu_size="256MiB",
            p2p_listen=f"127.0.0.1:{port}",
            p2p_peers=peers,
            p2p_auth_token=TOKEN,
            blocking_timeout_secs=5,
        )
        for d, port in zip(dirs, ports, strict=True)
    ]
    try:
        for proc in procs:
            proc.start()
        yield procs[0], procs[1]
    finally:
        for proc in procs:
            proc.stop()
        for d in dirs:
            remove_tempdir(d)


def _checker(model_dir: Path, url: str) -> ServerClient:
    config = Config.load(overrides={"chunk_size": CHUNK}, env={})
    return ServerClient(url, LAYOUT, model_name=str(model_dir), config=config).open()


def test_a_p2p_hit_through_vllm_equals_vllm_alone(
    model_dir: Path,
    instances: Instances,
    reference: dict[str, list[list[int]]],
    two_hosts: tuple[ServerProcess, ServerProcess],
) -> None:
    a, b = two_hosts
    first = instances.get("p2p-a", lambda: _instance(model_dir, "p2p-a", a.url))
    assert first.generate([PROMPTS[n] for n in FIRST]) == [reference[n][0] for n in FIRST]
    instances.close()

    checker = _checker(model_dir, b.url)
    try:
        wait_until(
            lambda: sum(checker.stats()["server"]["p2p"]["peers"].values()) == 3 + 2,
            what="B hears A's 5 chunks",
        )
        assert checker.stats()["tiers"]["cpu"]["entries"] == 0  # B holds none of its own
        second = instances.get("p2p-b", lambda: _instance(model_dir, "p2p-b", b.url))
        outs = second.generate([PROMPTS[n] for n in SECOND])
        assert outs == [reference[n][0] for n in SECOND]
        stats = second.stats()
        assert stats["found_tokens"] == EXPECTED_HITS
        p2p = checker.stats()["server"]["p2p"]
        assert p2p["pull_chunks"] >= 3 + 2 and p2p["pull_corrupt"] == 0, p2p
        instances.close()
    finally:
        checker.close()
    assert "Traceback" not in a.log() + b.log()
