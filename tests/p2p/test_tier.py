"""The p2p tier inside two servers' engines, as a lifecycle: stores on either host, loads on
either, requests abandoned after their lookup, with CPU tiers small enough to evict, so
announcements race with pulls. Whatever happens: every byte loaded is the byte stored, and
once the requests end both servers' references add up (``Engine.check_invariants``).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import kvtier
from kvtier import Config
from kvtier.server.client import ServerClient
from tests.conftest import SMALL_CHUNK, SMALL_LAYOUT, make_kv, make_tokens
from tests.server.server_helpers import CHUNK_BYTES, InProcess, remove_tempdir, short_tempdir

TOKEN = "a-fleet-secret-of-32-characters!"
BASE = make_tokens(3 * SMALL_CHUNK, 90)
# Six prompts of three chunks; pairs share their first zero, one or two chunks.
PROMPTS = [BASE[: SMALL_CHUNK * (k % 3)] + make_tokens(48, 91 + k)[: 48 - SMALL_CHUNK * (k % 3)]
           for k in range(6)]  # fmt: skip


def _kv(k: int) -> torch.Tensor:
    """Prompt ``k``'s KV: the shared BASE chunks' KV is the same in every prompt (same keys,
    same bytes, as a model computes), the rest its own."""
    kv = make_kv(48, 95 + k)
    shared = SMALL_CHUNK * (k % 3)
    kv[:, :, :shared] = make_kv(48, 94)[:, :, :shared]
    return kv


KVS = [_kv(k) for k in range(len(PROMPTS))]

SERVERS: list[InProcess] = []


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def servers() -> Iterator[list[InProcess]]:
    ports = [_port(), _port()]
    dirs = [short_tempdir(), short_tempdir()]
    peers = ",".join(f"127.0.0.1:{p}" for p in ports)
    made = [
        InProcess(
            d,
            max_local_cpu_size=f"{5 * CHUNK_BYTES}B",  # fewer pages than the prompts' chunks
            p2p_listen=f"127.0.0.1:{port}",
            p2p_peers=peers,
            p2p_auth_token=TOKEN,
            blocking_timeout_secs=2.0,
        )
        for d, port in zip(dirs, ports, strict=True)
    ]
    SERVERS[:] = made
    yield made
    for server in made:
        server.close()
    for d in dirs:
        remove_tempdir(d)


def _client(server: InProcess) -> ServerClient:
    config = Config.load(overrides={"chunk_size": SMALL_CHUNK}, env={})
    return kvtier.connect(server.url, SMALL_LAYOUT, model_name="p2p-life", config=config)


class P2PLifecycle(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clients = [_client(s) for s in SERVERS]
        self.loaded = 0

    def teardown(self) -> None:
        for c in self.clients:
            c.close()

    @rule(host=st.integers(0, 1), k=st.integers(0, 5))
    def store(self, host: int, k: int) -> None:
        self.clients[host].store(PROMPTS[k], KVS[k])

    @rule(host=st.integers(0, 1), k=st.integers(0, 5))
    def load(self, host: int, k: int) -> None:
        client = self.clients[host]
        with client.request("load"):
            hit = client.lookup(PROMPTS[k], "load").tokens
            got = client.retrieve(PROMPTS[k], "load")
        n = got.shape[2]
        assert n <= hit
        assert torch.equal(got, KVS[k][:, :, :n]), f"prompt {k}: {n} tokens differ"
        self.loaded += n

    @rule()
    def announcements_arrive(self) -> None:
        """Time passes: what each host stored or evicted reaches the other's directory."""
        time.sleep(0.05)

    @rule(host=st.integers(0, 1), k=st.integers(0, 5))
    def abandon(self, host: int, k: int) -> None:
        """A lookup whose request ends without loading (vLLM aborted it): pins go back."""
        client = self.clients[host]
        client.lookup(PROMPTS[k], "gone")
        client.end_request("gone")

    @invariant()
    def references_add_up(self) -> None:
        for server in SERVERS:
            for slot in server.server.models.slots():
                assert slot.engine.check_invariants() == []


@pytest.mark.usefixtures("servers")
def test_p2p_lifecycle() -> None:
    machine = P2PLifecycle.TestCase
    machine.settings = settings(
        max_examples=25,
        stateful_step_count=12,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    machine().runTest()
    pulled = sum(s.server.info()["p2p"]["pull_chunks"] for s in SERVERS)
    assert pulled > 0, "no load came from a peer: the lifecycle never crossed hosts"
