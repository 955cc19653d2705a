"""Several ``kvtier server``s on one machine, sharing their CPU tiers peer to peer.

Each server has its own socket directory and its own P2P port on loopback; they find each
other through ``p2p_peers`` (the same list for all). The peers that must die are real
``kvtier server`` processes (SIGSTOP, SIGKILL, a restart on the same port); the others run
in this process so the test can read their directory and audit their pages.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

import kvtier
from kvtier import Config, Engine
from kvtier.errors import AuthError
from kvtier.p2p import protocol as wire
from kvtier.p2p.node import P2PNode
from kvtier.request_salt import ExtraKeys, RequestSalt
from kvtier.server.client import ServerClient
from kvtier.trust.dial import connect
from kvtier.trust.handshake import Credentials
from tests.conftest import SMALL_LAYOUT, make_kv, make_tokens, small_config
from tests.server.server_helpers import (
    CHUNK_BYTES,
    InProcess,
    ServerProcess,
    remove_tempdir,
    short_tempdir,
    wait_until,
)

TOKEN = "a-fleet-secret-of-32-characters!"
TIMEOUT = 2.0  # blocking_timeout_secs: the longest a pull of a dead peer may cost
LEASE = 1.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def p2p(port: int, peers: list[int], **extra: object) -> dict[str, object]:
    return {
        "p2p_listen": f"127.0.0.1:{port}",
        "p2p_peers": ",".join(f"127.0.0.1:{p}" for p in peers),
        "p2p_auth_token": TOKEN,
        "p2p_lease_secs": LEASE,
        "blocking_timeout_secs": TIMEOUT,
        **extra,
    }


def client(url: str, model: str = "p2p-model", **overrides: object) -> ServerClient:
    values: dict[str, object] = {"chunk_size": 16, "blocking_timeout_secs": 10.0}
    values.update(overrides)
    config = Config.load(overrides=values, env={})
    return kvtier.connect(url, SMALL_LAYOUT, model_name=model, config=config)


def holders(server: InProcess, fingerprint: str, keys: list[bytes]) -> list[str | None]:
    node = server.server.p2p
    assert node is not None
    return node.directory.holders(fingerprint, keys)


def keys_of(c: ServerClient, tokens: list[int], salt: RequestSalt | None = None) -> list[bytes]:
    return [s.key for s in c.request_keys(tokens, cache_salt=salt).spans]


def audit(server: InProcess) -> list[str]:
    return [p for slot in server.server.models.slots() for p in slot.engine.check_invariants()]


@pytest.fixture
def new_dir() -> Iterator[Callable[[], str]]:
    """``new_dir()``: a short directory of its own for each server, removed at the end."""
    made: list[str] = []

    def new() -> str:
        made.append(short_tempdir())
        return made[-1]

    yield new
    for d in made:
        remove_tempdir(d)


@pytest.fixture
def pair() -> Iterator[tuple[InProcess, InProcess]]:
    """Two in-process servers that follow each other."""
    a_port, b_port = free_port(), free_port()
    a_dir, b_dir = short_tempdir(), short_tempdir()
    cpu = {"max_local_cpu_size": f"{32 * CHUNK_BYTES}B"}
    a = InProcess(a_dir, **p2p(a_port, [a_port, b_port]), **cpu)
    b = InProcess(b_dir, **p2p(b_port, [a_port, b_port]), **cpu)
    yield a, b
    b.close()
    a.close()
    remove_tempdir(a_dir)
    remove_tempdir(b_dir)


def test_a_chunk_stored_through_a_loads_through_b_with_the_same_bytes(
    pair: tuple[InProcess, InProcess],
) -> None:
    a, b = pair
    tokens, kv = make_tokens(96, 71), make_kv(96, 71)
    with client(a.url) as ca, client(b.url) as cb:
        assert ca.store(tokens, kv) == 6
        fp = cb.fingerprint.hex()
        keys = keys_of(cb, tokens)
        wait_until(lambda: None not in holders(b, fp, keys), what="B hears A's chunks")
        with cb.request("r"):
            assert cb.lookup(tokens, "r").tokens == 96
            got = cb.retrieve(tokens, "r")
        assert torch.equal(got, kv)
        stats = b.server.info()["p2p"]
        assert stats["pull_chunks"] == 6 and stats["pull_corrupt"] == 0
        assert a.server.info()["p2p"]["served_chunks"] == 6
        # B copied them into its own CPU tier, and announces them in turn.
        wait_until(lambda: None not in holders(a, fp, keys), what="A hears B's copies")
        assert audit(a) == [] and audit(b) == []


@pytest.mark.parametrize(
    ("mine", "other"),
    [
        ("tenant-1", "tenant-2"),
        (ExtraKeys(adapter=b"lora-A" * 4), ExtraKeys(adapter=b"lora-B" * 4)),
        (ExtraKeys(items=((16, 32, b"image-1"),)), ExtraKeys(items=((16, 32, b"image-2"),))),
    ],
    ids=["cache_salt", "lora", "image"],
)
def test_request_keys_hold_across_hosts(
    pair: tuple[InProcess, InProcess], mine: RequestSalt, other: RequestSalt
) -> None:
    """A request's salt, adapter and images seed its keys on every host: a peer's chunk of
    one is never another's hit (chunks before an image are shared, as within one host)."""
    a, b = pair
    tokens, kv = make_tokens(64, 72), make_kv(64, 72)
    with client(a.url) as ca, client(b.url) as cb:
        assert ca.store(tokens, kv, cache_salt=mine) == 4
        fp = cb.fingerprint.hex()
        salted = keys_of(cb, tokens, mine)
        theirs = keys_of(cb, tokens, other)
        shared = next(i for i, (x, y) in enumerate(zip(salted, theirs, strict=True)) if x != y)
        assert set(salted[shared:]).isdisjoint(theirs)
        wait_until(lambda: None not in holders(b, fp, salted), what="B hears A's chunks")
        assert holders(b, fp, theirs[shared:]) == [None] * (4 - shared)
        with cb.request("other"):
            assert cb.lookup(tokens, "other", cache_salt=other).tokens == 16 * shared
        with cb.request("mine"):
            assert cb.lookup(tokens, "mine", cache_salt=mine).tokens == 64
            assert torch.equal(cb.retrieve(tokens, "mine", cache_salt=mine), kv)


def test_a_wrong_secret_is_refused_and_claims_nothing() -> None:
    ok = P2PNode("127.0.0.1:0", [], token=TOKEN, lease_secs=LEASE, timeout=TIMEOUT).open()
    try:
        for token in ("another-secret-of-32-characters!", None):
            me = Credentials(wire.PROTOCOL, "intruder", token, "p2p_auth_token")
            with pytest.raises(AuthError):
                connect("127.0.0.1", ok.port, me, time.monotonic() + TIMEOUT, "the peer")
        wait_until(lambda: ok.refused == 2, what="both refusals counted")
        # A follower with the wrong secret learns nothing, and is never followed into.
        wrong = P2PNode(
            "127.0.0.1:0",
            [ok.address],
            token="another-secret-of-32-characters!",
            lease_secs=LEASE,
            timeout=TIMEOUT,
        ).open()
        try:
            wait_until(lambda: ok.refused >= 3, what="the follower refused")
            assert wrong.directory.peers() == {}
        finally:
            wrong.close()
    finally:
        ok.close()


def test_a_node_listed_under_another_address_does_not_follow_itself() -> None:
    """It listens on every interface and the fleet's list names it by loopback: without the
    handshake's node id it would follow itself and claim its own chunks as a peer's."""
    port = free_port()
    config = small_config()
    node = P2PNode(f"0.0.0.0:{port}", [f"127.0.0.1:{port}"], token=TOKEN, lease_secs=LEASE,
                   timeout=TIMEOUT)  # fmt: skip
    with Engine(config, SMALL_LAYOUT, model_name="self") as engine:
        cpu = engine.tier("cpu")
        assert cpu is not None
        node.attach(engine.fingerprint.hex(), cpu, SMALL_LAYOUT, engine.chunk_bytes)
        node.open()
        try:
            tokens = make_tokens(32, 76)
            assert engine.store(tokens, make_kv(32, 76)) == 2
            time.sleep(3 * LEASE)  # a follower of itself would have had its snapshot by now
            assert node.directory.peers() == {}
        finally:
            node.close()


def test_a_port_in_use_is_a_config_error_naming_p2p_listen() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        node = P2PNode(f"127.0.0.1:{port}", [], token=TOKEN, lease_secs=LEASE, timeout=TIMEOUT)
        with pytest.raises(kvtier.ConfigError, match=f"p2p_listen.*127.0.0.1:{port}"):
            node.open()


@pytest.mark.parametrize("host", ["0.0.0.0", "127.0.0.1"])
def test_a_node_without_a_secret_does_not_start(host: str) -> None:
    node = P2PNode(f"{host}:0", [], token=None, lease_secs=LEASE, timeout=TIMEOUT)
    with pytest.raises(kvtier.ConfigError, match="p2p_auth_token"):
        node.open()


def _server_process(directory: str, port: int, peers: list[int]) -> ServerProcess:
    return ServerProcess(
        directory, max_local_cpu_size=f"{32 * CHUNK_BYTES}B", **p2p(port, peers)
    ).start()


def test_a_peer_killed_mid_pull_costs_only_a_miss(new_dir: Callable[[], str]) -> None:
    a_port, b_port = free_port(), free_port()
    peers = [a_port, b_port]
    a = _server_process(new_dir(), a_port, peers)  # type: ignore[attr-defined]
    b = InProcess(new_dir(), **p2p(b_port, peers))  # type: ignore[attr-defined]
    assert a.proc is not None
    try:
        tokens, kv = make_tokens(128, 73), make_kv(128, 73)
        with client(a.url) as ca, client(b.url) as cb:
            assert ca.store(tokens, kv) == 8
            fp, keys = cb.fingerprint.hex(), keys_of(cb, tokens)
            wait_until(lambda: None not in holders(b, fp, keys), what="B hears A")
            os.kill(a.proc.pid, signal.SIGSTOP)  # the peer freezes: the pull will wait on it
            result: dict[str, object] = {}

            def pull() -> None:
                with cb.request("r"):
                    result["hit"] = cb.lookup(tokens, "r").tokens
                    result["kv"] = cb.retrieve(tokens, "r")

            started = time.monotonic()
            thread = threading.Thread(target=pull)
            thread.start()
            time.sleep(0.5)  # the pull is in flight, waiting on the frozen peer
            os.kill(a.proc.pid, signal.SIGKILL)
            thread.join(TIMEOUT + 10)
            assert not thread.is_alive(), "the pull hung on a dead peer"
            elapsed = time.monotonic() - started
            assert 0.5 <= elapsed < TIMEOUT + 5  # it waited on the peer, then not past it
            assert result["hit"] == 128  # the directory claimed all 8: the pull was tried
            got = result["kv"]
            assert isinstance(got, torch.Tensor)
            loaded = got.shape[2]
            assert loaded == 0  # the frozen, then killed, peer sent nothing: a miss
            assert torch.equal(got, kv[:, :, :loaded])
            assert audit(b) == [], "the puller's pages went back"
            wait_until(lambda: holders(b, fp, keys) == [None] * 8, what="A dropped")
            with cb.request("again"):
                assert cb.lookup(tokens, "again").tokens == loaded  # no false hit
    finally:
        b.close()
        a.stop()


def test_a_silent_peer_expires_with_its_lease_and_comes_back(
    new_dir: Callable[[], str],
) -> None:
    """Frozen (SIGSTOP: its connections stay open, nothing arrives), A is forgotten once its
    heartbeats are a lease late; thawed, it is followed again, its chunks claimed again."""
    a_port, b_port = free_port(), free_port()
    peers = [a_port, b_port]
    b = InProcess(new_dir(), **p2p(b_port, peers))
    a = _server_process(new_dir(), a_port, peers)
    assert a.proc is not None
    try:
        tokens, kv = make_tokens(32, 77), make_kv(32, 77)
        with client(a.url) as ca, client(b.url) as cb:
            assert ca.store(tokens, kv) == 2
            fp, keys = cb.fingerprint.hex(), keys_of(cb, tokens)
            wait_until(lambda: None not in holders(b, fp, keys), what="B hears A")
            os.kill(a.proc.pid, signal.SIGSTOP)
            frozen = time.monotonic()
            wait_until(lambda: holders(b, fp, keys) == [None, None], what="A expired")
            assert time.monotonic() - frozen < LEASE + 2
            with cb.request("r"):
                assert cb.lookup(tokens, "r").tokens == 0  # no claim of a silent peer
            os.kill(a.proc.pid, signal.SIGCONT)
            wait_until(lambda: None not in holders(b, fp, keys), what="A followed again")
            with cb.request("r2"):
                assert cb.lookup(tokens, "r2").tokens == 32
                assert torch.equal(cb.retrieve(tokens, "r2"), kv)
    finally:
        b.close()
        a.stop()


def test_a_peer_restarted_empty_is_dropped_from_the_directory(new_dir: Callable[[], str]) -> None:
    a_port, b_port = free_port(), free_port()
    peers = [a_port, b_port]
    b = InProcess(new_dir(), **p2p(b_port, peers))  # type: ignore[attr-defined]
    a_dir = new_dir()
    a = _server_process(a_dir, a_port, peers)
    try:
        tokens, kv = make_tokens(64, 74), make_kv(64, 74)
        with client(a.url) as ca, client(b.url) as cb:
            assert ca.store(tokens, kv) == 4
            fp, keys = cb.fingerprint.hex(), keys_of(cb, tokens)
            wait_until(lambda: None not in holders(b, fp, keys), what="B hears A")
        a.kill()
        a = _server_process(a_dir, a_port, peers)  # same port, empty CPU tier
        with client(a.url) as ca, client(b.url) as cb:
            # B follows the new A: what it stores now is heard, what the old A held is not.
            fresh_tokens = make_tokens(32, 75)
            assert ca.store(fresh_tokens, make_kv(32, 75)) == 2
            fresh = keys_of(cb, fresh_tokens)
            wait_until(lambda: None not in holders(b, fp, fresh), what="B follows the new A")
            assert holders(b, fp, keys) == [None] * 4
            with cb.request("r"):
                assert cb.lookup(tokens, "r").tokens == 0
            assert audit(b) == []
    finally:
        b.close()
        a.stop()


def test_a_wrong_token_is_one_line_a_minute_on_each_side_naming_the_cause(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A follower with another token used to log a line a second, forever, on both servers,
    and the honest one's never said "token". Now it redials with backoff and each side logs
    the cause once per interval."""
    ok = P2PNode("127.0.0.1:0", [], token=TOKEN, lease_secs=LEASE, timeout=TIMEOUT).open()
    caplog.set_level("INFO", logger="kvtier.p2p")
    try:
        wrong = P2PNode(
            "127.0.0.1:0",
            [ok.address],
            token="another-secret-of-32-characters!",
            lease_secs=LEASE,
            timeout=TIMEOUT,
        ).open()
        try:
            time.sleep(4.0)  # 1 s between dials would be 4 dials; backoff: 1 + 2 s -> <= 3
        finally:
            wrong.close()
    finally:
        ok.close()
    assert 1 <= ok.refused <= 3
    lines = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    listener = [m for m in lines if "P2P port: handshake" in m]
    follower = [m for m in lines if m.startswith(f"P2P peer {ok.address}")]
    assert len(listener) == 1 and "wrong or missing token" in listener[0]
    assert len(follower) == 1 and "p2p_auth_token differs" in follower[0]
