"""The handshake on real sockets, each side against a hand-made peer that lies: a listener
never welcomes a forged proof, a dialer never believes a forged listener, a proof never
passes reflected or on another protocol, and the whole exchange ends at its deadline."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from kvtier.errors import AuthError, ProtocolError, TransferTimeout
from kvtier.framing import HEADER, read_message
from kvtier.trust import handshake
from kvtier.trust.handshake import Challenge, Credentials, Hello, Proof, Refused, Welcome
from kvtier.trust.proofs import Side, Transcript, new_nonce, proof

TOKEN = "a-fleet-secret-of-32-characters!"
DIALER = Credentials("p2p", "dialer/1", TOKEN, "p2p_auth_token")
LISTENER = Credentials("p2p", "listener/2", TOKEN, "p2p_auth_token")
Pair = tuple[socket.socket, socket.socket]


@pytest.fixture
def pair() -> Iterator[Pair]:
    """A connected TCP pair on loopback: (the dialer's end, the listener's end)."""
    server = socket.create_server(("127.0.0.1", 0))
    dialer = socket.create_connection(server.getsockname(), timeout=10)
    listener, _ = server.accept()
    server.close()
    yield dialer, listener
    dialer.close()
    listener.close()


def in_thread(work: Callable[[], object]) -> Callable[[], object]:
    """Run ``work`` on a thread; the returned call joins it and returns (or raises) its result."""
    out: list[object] = []

    def run() -> None:
        try:
            out.append(work())
        except BaseException as exc:  # handed to the caller
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def result() -> object:
        thread.join(15)
        assert out, "the other side never finished"
        if isinstance(out[0], BaseException):
            raise out[0]
        return out[0]

    return result


def say(sock: socket.socket, message: handshake.Message) -> None:
    sock.sendall(handshake.FRAMING.encode(message))


def hear(sock: socket.socket) -> handshake.Message | None:
    return read_message(sock, handshake.FRAMING, time.monotonic() + 10)


def soon() -> float:
    return time.monotonic() + 10


def test_two_honest_sides_learn_each_others_identity(pair: Pair) -> None:
    dialer, listener = pair
    accepted = in_thread(lambda: handshake.accept(listener, LISTENER, soon()))
    assert handshake.dial(dialer, DIALER, soon(), "the listener") == "listener/2"
    assert accepted() == "dialer/1"


def test_a_listener_never_welcomes_a_forged_proof(pair: Pair) -> None:
    dialer, listener = pair
    accepted = in_thread(lambda: handshake.accept(listener, LISTENER, soon()))
    say(dialer, Hello("p2p", "intruder", new_nonce(), True))
    challenge = hear(dialer)
    assert isinstance(challenge, Challenge)
    # The best forgery at hand: the listener's own proof, reflected back as the dialer's.
    say(dialer, Proof(challenge.proof))
    refusal = hear(dialer)
    assert isinstance(refusal, Refused) and refusal.cause == "unauthorized"
    assert "p2p_auth_token differs" in refusal.why
    with pytest.raises(AuthError, match="failed authentication"):
        accepted()


def test_a_dialer_never_believes_a_forged_listener(pair: Pair) -> None:
    dialer, listener = pair
    dialed = in_thread(lambda: handshake.dial(dialer, DIALER, soon(), "the listener"))
    hello = hear(listener)
    assert isinstance(hello, Hello) and hello.proves
    nonce = new_nonce()
    wrong = Transcript("p2p", hello.identity, "liar", hello.nonce, nonce)
    say(listener, Challenge("liar", nonce, proof("another-secret-of-32-characters!",
                                                 Side.LISTENER, wrong)))  # fmt: skip
    refusal = hear(listener)  # the dialer says why, and sends no proof of its own
    assert isinstance(refusal, Refused) and "your proof failed" in refusal.why
    with pytest.raises(AuthError, match="p2p_auth_token differs"):
        dialed()


def test_a_listeners_proof_is_not_a_dialers_even_with_the_token_in_hand(pair: Pair) -> None:
    """A listener's proof for the very transcript the dialer must sign is refused: the side
    is bound, so no port that answers every dialer is an oracle for dialing another."""
    dialer, listener = pair
    accepted = in_thread(lambda: handshake.accept(listener, LISTENER, soon()))
    mine = new_nonce()
    say(dialer, Hello("p2p", "intruder", mine, True))
    challenge = hear(dialer)
    assert isinstance(challenge, Challenge)
    t = Transcript("p2p", "intruder", challenge.identity, mine, challenge.nonce)
    say(dialer, Proof(proof(TOKEN, Side.LISTENER, t)))
    assert isinstance(hear(dialer), Refused)
    with pytest.raises(AuthError):
        accepted()


def test_another_protocols_port_refuses_and_says_so(pair: Pair) -> None:
    dialer, listener = pair
    accepted = in_thread(lambda: handshake.accept(listener, LISTENER, soon()))
    pd = Credentials("pd-push", "sender", TOKEN, "pd_auth_token")
    with pytest.raises(ProtocolError, match="this port speaks p2p"):
        handshake.dial(dialer, pd, soon(), "the listener")
    with pytest.raises(ProtocolError, match="pd-push"):
        accepted()


@pytest.mark.parametrize("who_has_it", ["dialer", "listener"])
def test_a_token_on_one_side_only_is_refused_both_ways(pair: Pair, who_has_it: str) -> None:
    dialer, listener = pair
    bare = lambda c: Credentials(c.protocol, c.identity, None, c.secret_name)  # noqa: E731
    d = DIALER if who_has_it == "dialer" else bare(DIALER)
    listen = LISTENER if who_has_it == "listener" else bare(LISTENER)
    accepted = in_thread(lambda: handshake.accept(listener, listen, soon()))
    with pytest.raises(AuthError, match="p2p_auth_token"):
        handshake.dial(dialer, d, soon(), "the listener")
    with pytest.raises(AuthError, match="p2p_auth_token"):
        accepted()


def test_without_tokens_on_both_sides_it_still_exchanges_identities(pair: Pair) -> None:
    dialer, listener = pair
    bare_d = Credentials("pd-push", "s", None, "pd_auth_token")
    bare_l = Credentials("pd-push", "r", None, "pd_auth_token")
    accepted = in_thread(lambda: handshake.accept(listener, bare_l, soon()))
    assert handshake.dial(dialer, bare_d, soon(), "the listener") == "r"
    assert accepted() == "s"


def test_a_trickled_hello_ends_at_the_deadline_not_at_each_read(pair: Pair) -> None:
    dialer, listener = pair
    start = time.monotonic()
    accepted = in_thread(lambda: handshake.accept(listener, LISTENER, start + 0.5))
    frame = handshake.FRAMING.encode(Hello("p2p", "slow", new_nonce(), True))
    with pytest.raises(TransferTimeout):
        for i in range(len(frame)):  # a byte every 50 ms: each read well within any timeout
            dialer.sendall(frame[i : i + 1])
            time.sleep(0.05)
            if time.monotonic() - start > 0.8:
                accepted()  # it must have ended by now
        accepted()
    assert time.monotonic() - start < 1.5


def test_a_header_announcing_a_big_body_is_refused_before_anything_is_read(pair: Pair) -> None:
    dialer, listener = pair
    accepted = in_thread(lambda: handshake.accept(listener, LISTENER, soon()))
    dialer.sendall(HEADER.pack(handshake.MAGIC, handshake.VERSION, 4 << 20))
    with pytest.raises(ProtocolError, match="exceeds the 1024-byte limit"):
        accepted()


def test_an_identity_that_could_forge_a_log_line_is_refused(pair: Pair) -> None:
    dialer, listener = pair
    accepted = in_thread(lambda: handshake.accept(listener, LISTENER, soon()))
    say(dialer, Hello("p2p", "peer\nERROR forged line", new_nonce(), True))
    with pytest.raises(ProtocolError) as info:
        accepted()
    assert "\n" not in str(info.value) and "peer\\nERROR" in str(info.value)


def test_welcome_only_after_the_proof(pair: Pair) -> None:
    """The dialer's proof is checked before Welcome: a dialer that skips it gets nothing."""
    dialer, listener = pair
    accepted = in_thread(lambda: handshake.accept(listener, LISTENER, soon()))
    say(dialer, Hello("p2p", "intruder", new_nonce(), True))
    assert isinstance(hear(dialer), Challenge)
    say(dialer, Welcome())  # out of turn
    with pytest.raises(ProtocolError, match="expected Proof"):
        accepted()
