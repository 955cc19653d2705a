"""The PD ports' handshake (kvtier.trust's): a peer that cannot prove it knows pd_auth_token
plants nothing, and the receiver refuses to listen beyond loopback without a token. Real
sockets, every transport."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Iterator

import pytest
import torch

from kvtier import Engine, Service
from kvtier.errors import AuthError, ConfigError, TransferError
from kvtier.framing import read_message
from kvtier.pd.protocol import PUSH, AllocRequest, Hello, send_message
from kvtier.pd.receiver import PDReceiver
from kvtier.trust import handshake, loopback
from kvtier.trust.proofs import new_nonce
from tests.conftest import SMALL_LAYOUT, small_config
from tests.pd.pd_helpers import (
    CHANNELS,
    MODEL,
    PAGE_BYTES,
    assert_all_free,
    decoder,
    fake_prefill,
    keychain,
    request_tokens,
    send_one,
    sender,
)

TOKEN = "pd-secret-for-tests-0123456789"
Decoder = tuple[Engine, PDReceiver]


@pytest.fixture
def make_decoder() -> Iterator[Callable[..., Decoder]]:
    made: list[Decoder] = []

    def make(channel: str = "tcp", pages: int = 4, **overrides: object) -> Decoder:
        made.append(decoder(channel, pages, **overrides))
        return made[-1]

    yield make
    for engine, receiver in made:
        receiver.close()
        engine.close()


def hung_up(sock: socket.socket) -> bool:
    try:
        while chunk := sock.recv(65536):
            del chunk  # whatever it said last; we wait for the close
        return True
    except ConnectionResetError:
        return True


def loads_exactly(engine: Engine, rid: str, tokens: list[int]) -> bool:
    """The decoder's view: every token of the prompt is served, equal to a real prefill."""
    with engine.request(rid):
        kv = engine.retrieve(tokens, rid)
        return kv.shape[2] == len(tokens) and torch.equal(kv, fake_prefill(tokens))


# -- the rule: beyond loopback, a token -----------------------------------------------------
@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.2"])
def test_loopback_hosts(host: str) -> None:
    assert loopback.is_loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "", "::", "10.1.2.3", "192.168.0.1"])
def test_hosts_beyond_loopback(host: str) -> None:
    assert not loopback.is_loopback(host)


def test_listening_beyond_loopback_without_a_token_is_refused(
    make_decoder: Callable[..., Decoder],
) -> None:
    with pytest.raises(ConfigError) as info:
        make_decoder(host="0.0.0.0")
    assert info.value.key == "pd_auth_token" and "0.0.0.0" in str(info.value)
    # The Service (a decoder process) refuses the same way, and leaves nothing open.
    cfg = small_config(
        enable_pd=True, pd_role="receiver", pd_buffer_size=f"{4 * PAGE_BYTES}B", local_cpu=False
    ).with_overrides(pd_peer_host="0.0.0.0")
    service = Service(cfg, SMALL_LAYOUT, model_name=MODEL)
    with pytest.raises(ConfigError, match="pd_auth_token"):
        service.open()
    assert service.receiver is None and service.engine.state.value == "closed"


def test_with_a_token_it_listens_everywhere_and_serves_its_prefiller(
    make_decoder: Callable[..., Decoder],
) -> None:
    engine, receiver = make_decoder(host="0.0.0.0", pd_auth_token=TOKEN)
    tokens = request_tokens(1)
    with sender("tcp", receiver.port, token=TOKEN) as tx:
        send_one(tx, "r", tokens)
    assert receiver.wait_outcome("r", 5.0) is not None
    assert loads_exactly(engine, "r", tokens)
    assert_all_free(engine)


# -- attack (a): plant KV under a prefix the decoder will load -----------------------------
@pytest.mark.parametrize("channel", CHANNELS)
def test_a_peer_without_the_token_plants_nothing(
    make_decoder: Callable[..., Decoder], channel: str
) -> None:
    engine, receiver = make_decoder(channel, pd_auth_token=TOKEN)
    tokens = request_tokens(2)
    # A prefiller without the token, and one with another token: refused, before any KV.
    for token in (None, "another-secret-0123456789"):
        with pytest.raises(AuthError), sender(channel, receiver.port, token=token) as tx:
            send_one(tx, "planted", tokens)
    # A hand-made peer that skips the handshake and speaks PD straight away.
    chain = keychain()
    spans = chain.keys(tokens, include_partial=True)
    sock = socket.create_connection(("127.0.0.1", receiver.port), timeout=5.0)
    hello = Hello(chain.fingerprint.hex(), PAGE_BYTES, SMALL_LAYOUT.token_bytes(), channel)
    send_message(sock, hello)
    with contextlib.suppress(TransferError):  # the receiver may have hung up already
        send_message(sock, AllocRequest("planted", [s.key for s in spans], [16] * len(spans)))
    assert hung_up(sock)  # not a handshake frame: closed (a protocol error, not an auth one)
    sock.close()
    # One that says it has no token, and one that sends a nonce, then a made-up proof.
    for proves in (False, True):
        sock = socket.create_connection(("127.0.0.1", receiver.port), timeout=5.0)
        say = handshake.Hello(PUSH, "intruder", new_nonce(), proves)
        sock.sendall(handshake.FRAMING.encode(say))
        answer = read_message(sock, handshake.FRAMING)
        if proves:
            assert isinstance(answer, handshake.Challenge) and len(answer.proof) == 32
            sock.sendall(handshake.FRAMING.encode(handshake.Proof(bytes(32))))
            answer = read_message(sock, handshake.FRAMING)
        assert isinstance(answer, handshake.Refused) and answer.cause == "unauthorized"
        assert "pd_auth_token" in answer.why
        assert hung_up(sock)
        sock.close()

    assert receiver.auth_failures == 4
    from kvtier.observability.metrics import engine_registry

    assert engine_registry(engine).get_sample_value("kvtier_pd_auth_failures_total") == 4
    assert engine.lookup(tokens, "victim").tokens == 0  # nothing was planted
    engine.end_request("victim")
    assert_all_free(engine)
    with sender(channel, receiver.port, token=TOKEN) as tx:  # the real prefiller gets through
        send_one(tx, "real", tokens)
    assert receiver.wait_outcome("real", 5.0) is not None
    assert loads_exactly(engine, "real", tokens)
    assert_all_free(engine)


@pytest.mark.parametrize("channel", CHANNELS)
def test_a_sender_with_a_token_sends_nothing_to_a_receiver_that_cannot_prove_it(
    make_decoder: Callable[..., Decoder], channel: str
) -> None:
    engine, receiver = make_decoder(channel)  # loopback, no token: it cannot prove one
    with (
        pytest.raises(AuthError, match=r"requires pd_auth_token|has no pd_auth_token"),
        sender(channel, receiver.port, token=TOKEN) as tx,
    ):
        send_one(tx, "r", request_tokens(1))
    assert engine.stats()["open_requests"] == 0
    assert_all_free(engine)
