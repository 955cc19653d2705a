"""An attacker without the token against the real ports, all three at once and sharing one
token (the worst case: PD push, PD pull, P2P): relays, reflections and replays in every
pairing, then floods of slow connections. Nothing authenticates; nothing grows unbounded.

The attacker can dial any port, put any nonce, identity and protocol label it has seen (or
made up) in its Hello, and answer a Challenge with any proof it has seen: the listeners'
proofs from its own connections, or proofs eavesdropped from honest handshakes. It cannot
make an honest dialer dial it (that is an on-path position, out of scope: docs/security.md).
"""

from __future__ import annotations

import contextlib
import gc
import resource
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.errors import KVTierError
from kvtier.framing import read_message
from kvtier.p2p.node import MAX_PENDING, P2PNode
from kvtier.pd.protocol import PULL, PUSH
from kvtier.pd.receiver import PDReceiver
from kvtier.pd.source import PDSource
from kvtier.trust import handshake
from kvtier.trust.handshake import Challenge, Hello, Proof, Refused, Welcome
from kvtier.trust.proofs import Side, Transcript, new_nonce, proof
from tests.conftest import SMALL_LAYOUT, small_config
from tests.pd.pd_helpers import PAGE_BYTES, decoder, keychain, request_tokens

TOKEN = "one-secret-for-pd-and-p2p-32chr!"
PROTOCOLS = {"receiver": PUSH, "source": PULL, "p2p": "p2p"}


@dataclass
class Ports:
    receiver: PDReceiver
    source: PDSource
    node: P2PNode
    engine: object

    def port(self, name: str) -> int:
        return {"receiver": self.receiver.port, "source": self.source.port, "p2p": self.node.port}[
            name
        ]


@pytest.fixture(scope="module")
def ports() -> Iterator[Ports]:
    engine, receiver = decoder("tcp", 4, pd_auth_token=TOKEN)
    cfg = small_config(
        enable_pd=True,
        pd_role="sender",
        pd_buffer_size=f"{4 * PAGE_BYTES}B",
        pd_auth_token=TOKEN,
    )
    source = PDSource.from_config(cfg, SMALL_LAYOUT, keychain().fingerprint.hex()).open()
    node = P2PNode("127.0.0.1:0", [], token=TOKEN, lease_secs=5.0, timeout=2.0).open()
    try:
        yield Ports(receiver, source, node, engine)
    finally:
        node.close()
        source.close()
        receiver.close()
        engine.close()  # type: ignore[attr-defined]


def hear(sock: socket.socket) -> handshake.Message | None:
    try:
        return read_message(sock, handshake.FRAMING, time.monotonic() + 5)
    except KVTierError:
        return None  # closed or garbled: not a Welcome either way


def eavesdropped(ports: Ports, name: str) -> tuple[Challenge, bytes]:
    """An honest handshake with ``name``'s port (the test knows the token here, as an
    honest dialer would), as a passive listener on the wire would record it."""
    with socket.create_connection(("127.0.0.1", ports.port(name)), timeout=5) as sock:
        nonce = new_nonce()
        sock.sendall(handshake.FRAMING.encode(Hello(PROTOCOLS[name], "honest", nonce, True)))
        challenge = hear(sock)
        assert isinstance(challenge, Challenge)
        t = Transcript(PROTOCOLS[name], "honest", challenge.identity, nonce, challenge.nonce)
        mine = proof(TOKEN, Side.DIALER, t)
        sock.sendall(handshake.FRAMING.encode(Proof(mine)))
        assert isinstance(hear(sock), Welcome)  # the honest one is let in
        return challenge, mine


class Attacker(RuleBasedStateMachine):
    ports: Ports

    def __init__(self) -> None:
        super().__init__()
        self.nonces: list[bytes] = [new_nonce()]
        self.proofs: list[bytes] = [bytes(32)]
        self.identities: list[str] = ["intruder"]
        self.open: list[tuple[str, socket.socket]] = []  # connections awaiting our Proof
        self.welcomed = 0
        for name in PROTOCOLS:
            challenge, dialer_proof = eavesdropped(self.ports, name)
            self.nonces.append(challenge.nonce)
            self.proofs += [challenge.proof, dialer_proof]
            self.identities.append(challenge.identity)

    @rule(
        port=st.sampled_from(sorted(PROTOCOLS)),
        label=st.sampled_from(sorted(set(PROTOCOLS.values()))),
        nonce=st.integers(0, 1 << 16),
        identity=st.integers(0, 1 << 16),
    )
    def dial(self, port: str, label: str, nonce: int, identity: int) -> None:
        """Open a connection with a Hello made of what we have seen (relayed nonces and
        identities included) and collect the listener's Challenge."""
        sock = socket.create_connection(("127.0.0.1", self.ports.port(port)), timeout=5)
        hello = Hello(
            label,
            self.identities[identity % len(self.identities)],
            self.nonces[nonce % len(self.nonces)],
            True,
        )
        sock.sendall(handshake.FRAMING.encode(hello))
        answer = hear(sock)
        if isinstance(answer, Challenge):
            self.nonces.append(answer.nonce)
            self.proofs.append(answer.proof)
            self.identities.append(answer.identity)
            self.open.append((port, sock))
        else:
            assert answer is None or isinstance(answer, Refused)
            sock.close()

    @precondition(lambda self: bool(self.open))
    @rule(which=st.integers(0, 1 << 16), pick=st.integers(0, 1 << 16))
    def prove(self, which: int, pick: int) -> None:
        """Answer one open Challenge with any proof seen anywhere (a relay, a reflection, a
        replay of an honest session's): never a Welcome."""
        _, sock = self.open.pop(which % len(self.open))
        with sock:
            sock.sendall(handshake.FRAMING.encode(Proof(self.proofs[pick % len(self.proofs)])))
            answer = hear(sock)
        self.welcomed += isinstance(answer, Welcome)

    @invariant()
    def nothing_authenticates(self) -> None:
        assert self.welcomed == 0

    def teardown(self) -> None:
        for _, sock in self.open:
            sock.close()


def test_relays_reflections_and_replays_authenticate_nothing(ports: Ports) -> None:
    Attacker.ports = ports
    machine = Attacker.TestCase
    machine.settings = settings(max_examples=25, stateful_step_count=10, deadline=None)
    before = ports.receiver.auth_failures
    machine().runTest()
    assert ports.receiver.auth_failures > before  # the attempts were refused as auth failures
    tokens = request_tokens(1)
    engine = ports.engine
    assert engine.lookup(tokens, "victim").tokens == 0  # type: ignore[attr-defined]
    engine.end_request("victim")  # type: ignore[attr-defined]


def test_the_round_6_relay_plants_nothing(ports: Ports) -> None:
    """D1 as it was found: read the PD source's opening, carry it to the decoder's receiver,
    carry the receiver's Challenge back to the source, hand the source's answer over. Today
    the source is a listener and speaks only after a dialer's Hello: its proof is a
    listener's on pd-pull, and the receiver wants a dialer's on pd-push."""
    src = socket.create_connection(("127.0.0.1", ports.source.port), timeout=5)
    rcv = socket.create_connection(("127.0.0.1", ports.receiver.port), timeout=5)
    with src, rcv:
        # Open the receiver first, then offer the source the receiver's own nonce.
        hello = Hello(PUSH, "relay", new_nonce(), True)
        rcv.sendall(handshake.FRAMING.encode(hello))
        challenge_r = hear(rcv)
        assert isinstance(challenge_r, Challenge)
        for label in (PULL, PUSH):  # the source's own protocol, and the receiver's
            with socket.create_connection(("127.0.0.1", ports.source.port), timeout=5) as s:
                s.sendall(handshake.FRAMING.encode(Hello(label, "relay", hello.nonce, True)))
                challenge_s = hear(s)
                if isinstance(challenge_s, Challenge):
                    rcv_proof = challenge_s.proof
                    break
        else:
            rcv_proof = bytes(32)
        rcv.sendall(handshake.FRAMING.encode(Proof(rcv_proof)))
        assert not isinstance(hear(rcv), Welcome)


def rss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


@pytest.mark.parametrize("name", ["p2p", "receiver"])
def test_slow_connections_hold_bounded_threads_and_memory(ports: Ports, name: str) -> None:
    """48 dialers that send a byte every 0.1 s and never finish a Hello (D2: each used to
    get a thread and up to 4 MiB): at most MAX_PENDING are held at once, each with a
    header's worth of memory, all closed at the handshake deadline; then an honest peer gets
    in. (While the flood holds every pending slot an honest dialer is refused at once, not
    held: it redials, and the flood holds the slots for one handshake deadline each.)"""
    port = ports.port(name)
    guard = ports.node.guard if name == "p2p" else ports.receiver.guard
    threads_before = threading.active_count()
    gc.collect()
    rss_before = rss_kib()
    frame = handshake.FRAMING.encode(Hello(PROTOCOLS[name], "slow", new_nonce(), True))
    slow = []
    for _ in range(48):
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        sock.setblocking(False)
        slow.append(sock)
    start = time.monotonic()
    peak_threads = 0
    for i in range(len(frame)):
        for sock in slow:
            with contextlib.suppress(OSError):  # refused at the cap, or closed at the deadline
                sock.send(frame[i : i + 1])
        peak_threads = max(peak_threads, threading.active_count() - threads_before)
        time.sleep(0.1)
        if time.monotonic() - start > 6:
            break
    for sock in slow:
        sock.close()
    assert peak_threads <= guard.max_pending + 1  # one per pending handshake, at most
    assert guard.refused >= 48 - guard.max_pending
    assert rss_kib() - rss_before < 32 * 1024  # KiB: no body allocated before a proof
    deadline = time.monotonic() + 10
    while len(guard) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(guard) == 0  # every slow one closed by its deadline
    eavesdropped(ports, name)  # and the port serves an honest dialer again
    assert ports.node.guard.max_pending == MAX_PENDING


def relay_to(port: int) -> tuple[int, socket.socket]:
    """A transparent TCP relay on another port of this host: it passes every byte both ways
    (what an attacker at an address a request names can do)."""
    listener = socket.create_server(("127.0.0.1", 0))

    def pipe(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def serve() -> None:
        with contextlib.suppress(OSError):
            near, _ = listener.accept()
            far = socket.create_connection(("127.0.0.1", port))
            threading.Thread(target=pipe, args=(near, far), daemon=True).start()
            pipe(far, near)

    threading.Thread(target=serve, daemon=True).start()
    return listener.getsockname()[1], listener


def test_a_decoder_told_to_pull_from_a_relay_refuses_it(ports: Ports) -> None:
    """The address a decoder pulls from is in the request's kv_transfer_params: a client
    that reaches the decoder can name its own relay there. The relay passes the real
    source's handshake through untouched, so the proofs verify; but the source names its
    own address in them, and the decoder dialed another: refused before any PD frame."""
    from kvtier.pd.puller import Puller

    port, listener = relay_to(ports.source.port)
    with listener:
        outcome = Puller(ports.receiver).pull("127.0.0.1", port, "t", [b"k" * 16])
    assert not outcome.ok and "not the PD source" in outcome.reason
    # The same pull straight to the source gets past the handshake (the transfer is unknown).
    direct = Puller(ports.receiver).pull(*ports.source.address, "t", [b"k" * 16])
    assert not direct.ok and "prefiller refused" in direct.reason
