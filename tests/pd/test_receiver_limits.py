"""What bounds a PD peer: reservations nobody claims expire, stalled or idle connections are
closed, connections are capped; after each attack the real prefiller still gets through."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from kvtier import Engine
from kvtier.pd.channels.base import checksum
from kvtier.pd.protocol import (
    PUSH,
    AllocReply,
    AllocRequest,
    ChunkSent,
    DoneReply,
    RequestDone,
    recv_message,
    send_message,
)
from kvtier.pd.receiver import PDReceiver
from kvtier.trust import handshake
from tests.pd.pd_helpers import (
    CHANNELS,
    assert_all_free,
    decoder,
    fake_prefill,
    keychain,
    pd_tier,
    request_tokens,
    send_one,
    sender,
)
from tests.waiting import wait_until

TOKEN = "pd-secret-for-tests-0123456789"
Decoder = tuple[Engine, PDReceiver]


@pytest.fixture
def make_decoder() -> Iterator[Callable[..., Decoder]]:
    made: list[Decoder] = []

    def make(channel: str = "tcp", pages: int = 4, **overrides: object) -> Decoder:
        made.append(decoder(channel, pages, pd_auth_token=TOKEN, **overrides))
        return made[-1]

    yield make
    for engine, receiver in made:
        receiver.close()
        engine.close()


def hung_up(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except (ConnectionResetError, TimeoutError):
        return False


def loads_exactly(engine: Engine, rid: str, tokens: list[int]) -> bool:
    with engine.request(rid):
        kv = engine.retrieve(tokens, rid)
        return kv.shape[2] == len(tokens) and torch.equal(kv, fake_prefill(tokens))


# -- attack (b): hold the buffer under requests the decoder never ends ---------------------
@pytest.mark.parametrize("channel", CHANNELS)
def test_reservations_nobody_looks_up_expire_and_the_real_prefiller_gets_room(
    make_decoder: Callable[..., Decoder], channel: str
) -> None:
    """A request cancelled upstream or routed to another decoder (or a peer holding the
    buffer on purpose) reserves every page; the decoder never looks it up. Past
    pd_reservation_ttl_sec its pages go back, once, and the real prefiller's request fits."""
    engine, receiver = make_decoder(channel, pages=4, pd_reservation_ttl_sec=0.5)
    ghost = request_tokens(0)  # 2 system chunks + user chunks: 3-4 pages
    real = request_tokens(1, seed=5)
    with sender(channel, receiver.port, token=TOKEN) as tx:
        send_one(tx, "ghost", ghost)
        assert pd_tier(engine).pool.free_pages <= 1  # no room for the real one now
        start = time.monotonic()
        with sender(channel, receiver.port, timeout=10.0, token=TOKEN) as real_tx:
            send_one(real_tx, "real", real)  # waits for room; the expiry makes it
        assert time.monotonic() - start < 5.0
    assert receiver.expired_reservations == 1
    assert engine.end_request("ghost") is False  # already ended by the expiry: no-op
    assert engine.lookup(ghost, "late").tokens == 0  # gone with its pages
    engine.end_request("late")
    assert loads_exactly(engine, "real", real)
    assert engine.check_invariants() == []
    assert_all_free(engine)


@pytest.mark.parametrize("channel", CHANNELS)
def test_a_request_the_decoder_looked_up_never_expires(
    make_decoder: Callable[..., Decoder], channel: str
) -> None:
    engine, receiver = make_decoder(channel, pages=8, pd_reservation_ttl_sec=1.0)
    tokens = request_tokens(2)
    unclaimed = request_tokens(1, seed=5)  # another system prompt: no chunk in common
    with sender(channel, receiver.port, token=TOKEN) as tx:
        send_one(tx, "kept", tokens)
        send_one(tx, "unclaimed", unclaimed)  # the control: nobody looks it up
    assert engine.lookup(tokens, "kept").tokens == len(tokens)  # claimed by the request itself
    # The sweep that expires the control, sent with it, has passed over the kept one too.
    wait_until(lambda: receiver.expired_reservations > 0, 10, "the unclaimed one to expire")
    assert receiver.expired_reservations == 1
    assert engine.lookup(unclaimed, "late").tokens == 0  # gone with its pages
    engine.end_request("late")
    assert loads_exactly(engine, "kept", tokens)
    assert_all_free(engine)


def test_a_transfer_slower_than_the_ttl_completes_and_its_ttl_starts_after(
    make_decoder: Callable[..., Decoder],
) -> None:
    """A sender slower than the TTL is not cut off (its pages could be handed to another
    request while it still writes into them): the TTL counts from the end of the transfer.
    Left unclaimed after that, it expires like any other."""
    engine, receiver = make_decoder("tcp", pd_reservation_ttl_sec=0.6)
    tokens = request_tokens(3)
    spans = keychain().keys(tokens, include_partial=True)
    kv = fake_prefill(tokens)
    with sender("tcp", receiver.port, token=TOKEN) as tx:
        sock = tx._sock
        assert sock is not None
        keys, sizes = [s.key for s in spans], [s.num_tokens for s in spans]
        send_message(sock, AllocRequest("slow", keys, sizes))
        assert isinstance(recv_message(sock), AllocReply)
        for i, span in enumerate(spans):
            data = kv[:, :, span.start : span.end, :].contiguous().view(-1).view(torch.uint8)
            send_message(sock, ChunkSent("slow", i, data.numel(), 0))
            sock.sendall(data.numpy().tobytes() + checksum(data).to_bytes(8, "big"))
            time.sleep(0.4)  # in all slower than the TTL; each within the message timeout
        send_message(sock, RequestDone("slow"))
        done = recv_message(sock)
    assert isinstance(done, DoneReply) and done.ok, done
    assert receiver.expired_reservations == 0
    wait_until(lambda: receiver.expired_reservations == 1, 10, "its expiry, once unclaimed")
    assert engine.lookup(tokens, "slow").tokens == 0
    engine.end_request("slow")
    assert_all_free(engine)


# -- attack (c): a thread held per half-sent frame -----------------------------------------
@pytest.mark.parametrize("channel", CHANNELS)
def test_half_sent_frames_are_dropped_and_connections_are_capped(
    make_decoder: Callable[..., Decoder], channel: str
) -> None:
    engine, receiver = make_decoder(
        channel, pd_max_connections=4, pd_message_timeout_sec=0.5, pd_idle_timeout_sec=1.0
    )
    stalled = []
    for _ in range(4):  # each holds a receiver thread with half a frame header
        sock = socket.create_connection(("127.0.0.1", receiver.port), timeout=5.0)
        sock.sendall(b"KVP")
        stalled.append(sock)
    wait_until(lambda: len(receiver.guard) == 4, 10, "4 connections held by the guard")
    extra = socket.create_connection(("127.0.0.1", receiver.port), timeout=5.0)
    assert hung_up(extra)  # over the cap: closed at once
    extra.close()
    assert receiver.guard.refused == 1
    start = time.monotonic()
    for sock in stalled:  # dropped at the message deadline
        assert hung_up(sock)
        sock.close()
    assert time.monotonic() - start < 3.0
    wait_until(lambda: receiver.guard.timeouts == 4 and not len(receiver.guard), 10, "4 timeouts")
    tokens = request_tokens(4)
    with sender(channel, receiver.port, token=TOKEN) as tx:
        send_one(tx, "real", tokens)
    assert loads_exactly(engine, "real", tokens)
    assert_all_free(engine)


def test_a_byte_at_a_time_is_still_one_message_deadline(
    make_decoder: Callable[..., Decoder],
) -> None:
    """Slowloris: every byte arrives before any per-read timeout would fire, but the
    handshake as a whole must finish within pd_message_timeout_sec."""
    engine, receiver = make_decoder("tcp", pd_message_timeout_sec=0.6)
    data = handshake.FRAMING.encode(handshake.Hello(PUSH, "slow", b"n" * 32, True))
    sock = socket.create_connection(("127.0.0.1", receiver.port), timeout=5.0)
    closed = threading.Event()
    start = time.monotonic()
    try:
        for i in range(len(data)):
            sock.sendall(data[i : i + 1])
            time.sleep(0.1)
            if time.monotonic() - start > 3.0:
                break
    except (BrokenPipeError, ConnectionResetError):
        closed.set()
    assert closed.is_set() or hung_up(sock)
    assert time.monotonic() - start < 2.5
    sock.close()
    wait_until(lambda: receiver.guard.timeouts == 1, 10, "one timeout")
    assert_all_free(engine)


def test_an_idle_connection_is_closed_and_the_sender_reconnects(
    make_decoder: Callable[..., Decoder],
) -> None:
    engine, receiver = make_decoder("tcp", pd_idle_timeout_sec=0.4)
    tokens = request_tokens(5)
    with sender("tcp", receiver.port, token=TOKEN) as tx:
        send_one(tx, "a", tokens)
        assert loads_exactly(engine, "a", tokens)
        timed_out = lambda: receiver.guard.timeouts == 1 and not len(receiver.guard)  # noqa: E731
        wait_until(timed_out, 10, "the idle connection's timeout")
        send_one(tx, "b", tokens)  # a fresh connection, transparently
    assert loads_exactly(engine, "b", tokens)
    assert_all_free(engine)


def test_a_stalled_handshake_does_not_block_close(make_decoder: Callable[..., Decoder]) -> None:
    _, receiver = make_decoder("tcp")
    sock = socket.create_connection(("127.0.0.1", receiver.port), timeout=5.0)
    sock.sendall(b"K")
    wait_until(lambda: len(receiver.guard) == 1, 10, "one connection held by the guard")
    start = time.monotonic()
    receiver.close()
    assert time.monotonic() - start < 2.0
    sock.close()
