"""The receiver against real sockets in this process: the happy path on each transport,
backpressure, aborts, broken and hostile senders. Every test ends with the buffer free."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterator

import pytest
import torch

from kvtier import Engine
from kvtier.errors import TransferError, TransferTimeout
from kvtier.pd.channels.base import checksum
from kvtier.pd.protocol import (
    Abort,
    AllocReply,
    AllocRequest,
    ChunkSent,
    DoneReply,
    Hello,
    HelloReply,
    RequestDone,
    recv_message,
    send_message,
)
from kvtier.pd.receiver import PDReceiver
from kvtier.pd.sender import PDSender
from tests.conftest import SMALL_LAYOUT
from tests.pd.pd_helpers import (
    CHANNELS,
    PAGE_BYTES,
    assert_all_free,
    decoder,
    fake_prefill,
    keychain,
    pd_connect,
    pd_tier,
    request_tokens,
    send_one,
    sender,
)

Decoder = tuple[Engine, PDReceiver]


@pytest.fixture
def make_decoder() -> Iterator[Callable[..., Decoder]]:
    made: list[Decoder] = []

    def make(channel: str = "tcp", pages: int = 4, timeout: float = 2.0) -> Decoder:
        made.append(decoder(channel, pages, timeout))
        return made[-1]

    yield make
    for engine, receiver in made:
        receiver.close()
        engine.close()


def decode(engine: Engine, receiver: PDReceiver, rid: str, tokens: list[int]) -> int:
    """What the decoder does per request: learn the transfer outcome, load what arrived,
    check it equals a local prefill, end the request. Returns the tokens loaded."""
    outcome = receiver.wait_outcome(rid, 10.0)
    assert outcome is not None, f"no outcome for {rid}"
    with engine.request(rid):
        kv = engine.retrieve(tokens, rid)
        hit = kv.shape[2]
        assert torch.equal(kv, fake_prefill(tokens)[:, :, :hit]), rid
        if outcome.ok:
            assert hit == len(tokens)
        return hit


@pytest.mark.parametrize("channel", CHANNELS)
def test_requests_with_shared_prefixes_arrive_and_free(
    make_decoder: Callable[..., Decoder], channel: str
) -> None:
    engine, receiver = make_decoder(channel, pages=8)
    with sender(channel, receiver.port) as tx:
        for i in range(12):
            tokens = request_tokens(i)
            send_one(tx, f"r{i}", tokens)
            assert decode(engine, receiver, f"r{i}", tokens) == len(tokens)
    assert pd_tier(engine).counters.stored > 0
    assert_all_free(engine)


def test_full_buffer_times_out_on_both_sides_and_decoder_prefills(
    make_decoder: Callable[..., Decoder],
) -> None:
    first, second = request_tokens(0), request_tokens(1)
    pages = len(keychain().keys(first, include_partial=True))
    engine, receiver = make_decoder("tcp", pages=pages, timeout=0.2)
    with sender("tcp", receiver.port, timeout=0.2) as tx:
        send_one(tx, "first", first)  # 3 pages, held until the decoder ends "first"
        with pytest.raises(TransferTimeout, match="no room"):
            send_one(tx, "second", second)
        outcome = receiver.wait_outcome("second", 5.0)
        assert outcome is not None and not outcome.ok and "no room" in outcome.reason
        assert decode(engine, receiver, "first", first) == len(first)
        with engine.request("second"):  # fallback: nothing arrived, prefill locally
            assert engine.lookup(second, "second").tokens == 0
        send_one(tx, "second-again", second)  # room is back; same connection still works
        assert decode(engine, receiver, "second-again", second) == len(second)
    assert_all_free(engine)


def test_oversized_request_fails_at_once(make_decoder: Callable[..., Decoder]) -> None:
    engine, receiver = make_decoder("tcp", pages=4, timeout=30.0)
    with sender("tcp", receiver.port) as tx:
        with pytest.raises(TransferError, match="too_large"):
            send_one(tx, "big", request_tokens(49))
        send_one(tx, "small", request_tokens(2))
    outcome = receiver.wait_outcome("big", 5.0)
    assert outcome is not None and not outcome.ok
    engine.end_request("big")
    decode(engine, receiver, "small", request_tokens(2))
    assert_all_free(engine)


def test_abort_mid_transfer_releases_the_reservation(make_decoder: Callable[..., Decoder]) -> None:
    engine, receiver = make_decoder("tcp", pages=4)
    tokens = request_tokens(3)
    with sender("tcp", receiver.port) as tx:
        with pytest.raises(TransferError, match="aborted"):
            send_one(tx, "r", tokens, abort_after=1)
        outcome = receiver.wait_outcome("r", 5.0)
        assert outcome is not None and not outcome.ok and outcome.chunks == 1
        assert pd_tier(engine).pool.free_pages == 4  # released before the request ends
        assert engine.end_request("r")  # the decoder's side of the abort
        send_one(tx, "next", tokens)
        assert decode(engine, receiver, "next", tokens) == len(tokens)
    assert_all_free(engine)


def test_a_failed_transfer_reports_only_what_is_still_held(
    make_decoder: Callable[..., Decoder],
) -> None:
    """While a transfer is in flight its reservation is pinned and described as received so
    far; once the transfer fails (the reservation released early), the request's lease
    reports nothing held: stats, /leases and kvtier_pinned_bytes alike."""
    from kvtier.observability.metrics import engine_registry

    engine, receiver = make_decoder("tcp", pages=4)
    registry = engine_registry(engine)
    tokens = request_tokens(3)
    spans = keychain().keys(tokens, include_partial=True)
    kv = fake_prefill(tokens)
    sock, _ = raw_client(receiver.port)
    send_message(sock, AllocRequest("r", [s.key for s in spans], [s.num_tokens for s in spans]))
    assert isinstance(recv_message(sock), AllocReply)
    data = kv[:, :, spans[0].start : spans[0].end, :].contiguous().view(-1).view(torch.uint8)
    send_message(sock, ChunkSent("r", 0, data.numel(), 0))
    sock.sendall(data.numpy().tobytes() + checksum(data).to_bytes(8, "big"))
    wait_until(lambda: pd_tier(engine).counters.stored == 1)
    (info,) = engine.leases()
    assert info.pinned_bytes == len(spans) * PAGE_BYTES
    assert info.holds == (f"pd reservation of {len(spans)} pages (1 of {len(spans)} received)",)
    send_message(sock, Abort("r", "prefill failed"))
    outcome = receiver.wait_outcome("r", 5.0)
    assert outcome is not None and not outcome.ok
    sock.close()
    assert pd_tier(engine).pool.free_pages == 4  # released before the request ends
    assert engine.stats()["pinned_bytes"] == 0
    assert all(i.pinned_bytes == 0 and i.holds == () for i in engine.leases())
    assert engine.leaks() == []
    assert registry.get_sample_value("kvtier_pinned_bytes") == 0
    engine.end_request("r")
    assert_all_free(engine)


def raw_client(port: int, channel: str = "tcp") -> tuple[socket.socket, HelloReply]:
    sock = pd_connect(port)
    chain = keychain()
    hello = Hello(chain.fingerprint.hex(), PAGE_BYTES, PAGE_BYTES // 16, channel)
    send_message(sock, hello)
    reply = recv_message(sock)
    assert isinstance(reply, HelloReply)
    return sock, reply


def hung_up(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def wait_until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    event = threading.Event()
    for _ in range(int(timeout / 0.01)):
        if cond():
            return
        event.wait(0.01)
    raise AssertionError("condition not reached")


def test_garbage_closes_that_connection_only(
    make_decoder: Callable[..., Decoder], caplog: pytest.LogCaptureFixture
) -> None:
    engine, receiver = make_decoder("tcp", pages=4)
    tokens = request_tokens(5)
    spans = keychain().keys(tokens, include_partial=True)
    with caplog.at_level(logging.ERROR, logger="kvtier.pd.receiver"):
        bad, _ = raw_client(receiver.port)
        send_message(
            bad, AllocRequest("bad", [s.key for s in spans], [s.num_tokens for s in spans])
        )
        assert isinstance(recv_message(bad), AllocReply)
        bad.sendall(b"\xff" * 64)  # garbage mid-request
        assert hung_up(bad)  # the receiver hung up
        bad.close()
    assert receiver.protocol_errors == 1
    assert any(
        "protocol error" in r.getMessage() or "magic" in r.getMessage() for r in caplog.records
    )
    wait_until(lambda: pd_tier(engine).pool.free_pages == 4)
    engine.end_request("bad")
    with sender("tcp", receiver.port) as tx:  # others are still served
        send_one(tx, "good", tokens)
    assert decode(engine, receiver, "good", tokens) == len(tokens)
    assert_all_free(engine)


def test_oversized_frame_and_wrong_fingerprint_are_refused(
    make_decoder: Callable[..., Decoder],
) -> None:
    engine, receiver = make_decoder("tcp", pages=4)
    sock, _ = raw_client(receiver.port)
    sock.sendall(b"KVP\x01" + (1 << 30).to_bytes(4, "big"))
    assert hung_up(sock)
    sock.close()
    other = pd_connect(receiver.port)
    send_message(other, Hello("0" * 16, PAGE_BYTES, PAGE_BYTES // 16, "tcp"))
    assert hung_up(other)
    other.close()
    wait_until(lambda: receiver.protocol_errors == 2)
    assert_all_free(engine)


def test_a_bad_checksum_is_reported_and_never_served(make_decoder: Callable[..., Decoder]) -> None:
    engine, receiver = make_decoder("tcp", pages=4)
    tokens = request_tokens(6)
    spans = keychain().keys(tokens, include_partial=True)
    kv = fake_prefill(tokens)
    sock, _ = raw_client(receiver.port)
    send_message(sock, AllocRequest("r", [s.key for s in spans], [s.num_tokens for s in spans]))
    reply = recv_message(sock)
    assert isinstance(reply, AllocReply)
    for i, _page in zip(range(len(spans)), reply.pages, strict=True):
        data = kv[:, :, spans[i].start : spans[i].end, :].contiguous().view(-1).view(torch.uint8)
        send_message(sock, ChunkSent("r", i, data.numel(), 0))
        sock.sendall(data.numpy().tobytes() + (42).to_bytes(8, "big"))  # a wrong checksum
    send_message(sock, RequestDone("r"))
    done = recv_message(sock)
    assert isinstance(done, DoneReply) and not done.ok and "checksum" in done.message
    sock.close()
    outcome = receiver.wait_outcome("r", 5.0)
    assert outcome is not None and not outcome.ok
    assert engine.lookup(tokens, "r").tokens == 0  # nothing corrupt is ever served
    engine.end_request("r")
    assert pd_tier(engine).counters.corrupt == len(spans)
    assert_all_free(engine)


def test_sender_reconnects_after_the_receiver_drops_it(
    make_decoder: Callable[..., Decoder],
) -> None:
    engine, receiver = make_decoder("tcp", pages=4)
    tx: PDSender = sender("tcp", receiver.port)
    tokens = request_tokens(8)
    with tx:
        send_one(tx, "a", tokens)
        decode(engine, receiver, "a", tokens)
        assert tx._sock is not None
        tx._sock.shutdown(socket.SHUT_RDWR)  # the link breaks between requests
        send_one(tx, "b", tokens)  # seen before the request starts: a fresh connection
        decode(engine, receiver, "b", tokens)
        tx._sock.shutdown(socket.SHUT_WR)  # half-broken: the receiver hangs up on it
        wait_until(lambda: not len(receiver.guard))
        send_one(tx, "c", tokens)
        decode(engine, receiver, "c", tokens)
    assert_all_free(engine)


@pytest.mark.parametrize("channel", CHANNELS)
def test_transfer_arriving_after_the_decoder_ended_the_request_is_refused(
    make_decoder: Callable[..., Decoder], channel: str
) -> None:
    """The decoder gave up on a request (ended it, prefilled locally) before the prefiller's
    transfer arrived: the late reservation must not open a lease nobody would ever end."""
    engine, receiver = make_decoder(channel)
    tokens = request_tokens(1)
    engine.lookup(tokens, "late")
    engine.end_request("late")
    with sender(channel, receiver.port) as tx, pytest.raises(TransferError, match="ended"):
        send_one(tx, "late", tokens)
    outcome = receiver.wait_outcome("late", 5.0)
    assert outcome is not None and not outcome.ok
    assert_all_free(engine)
    with sender(channel, receiver.port) as tx:  # and the receiver keeps serving
        send_one(tx, "next", tokens)
    assert decode(engine, receiver, "next", tokens) > 0
    assert_all_free(engine)


def test_outcomes_nobody_collects_are_bounded(
    make_decoder: Callable[..., Decoder], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvtier.pd import outcomes

    monkeypatch.setattr(outcomes, "MAX_UNCOLLECTED_OUTCOMES", 3)
    engine, receiver = make_decoder("tcp")
    with sender("tcp", receiver.port) as tx:
        for i in range(5):
            send_one(tx, f"uncollected-{i}", request_tokens(i))
            engine.end_request(f"uncollected-{i}")
    assert receiver.wait_outcome("uncollected-0", 0.1) is None  # the oldest were dropped
    assert receiver.wait_outcome("uncollected-4", 0.1) is not None
    assert_all_free(engine)


def test_transfers_and_failures_reach_the_decoders_metrics(
    make_decoder: Callable[..., Decoder],
) -> None:
    from kvtier.observability.metrics import engine_registry

    engine, receiver = make_decoder("tcp", pages=4)
    registry = engine_registry(engine)
    tokens = request_tokens(2)
    with sender("tcp", receiver.port) as tx:
        send_one(tx, "ok", tokens)
        with pytest.raises(TransferError):
            send_one(tx, "too-big", request_tokens(49))  # 12 chunks into a 4-page buffer
    decode(engine, receiver, "ok", tokens)
    assert receiver.wait_outcome("too-big", 5.0) is not None
    assert registry.get_sample_value("kvtier_pd_transfers_total") == 1
    assert registry.get_sample_value("kvtier_pd_transfer_failures_total") == 1
    assert registry.get_sample_value("kvtier_pd_received_bytes_total") > 0
    assert_all_free(engine)


def test_shm_verifies_at_serve_time_and_a_changed_page_ends_the_hit(
    make_decoder: Callable[..., Decoder],
) -> None:
    """shm publishes without hashing (the sender hashed while copying); the decoder checks
    every byte against the sender's checksum as it copies the chunk out. A page changed after
    the transfer is a checksum miss there: the hit ends before it, the rest is recomputed."""
    engine, receiver = make_decoder("shm", pages=8)
    tokens = request_tokens(3)
    spans = keychain().keys(tokens, include_partial=True)
    assert len(spans) >= 3
    with sender("shm", receiver.port) as tx:
        send_one(tx, "r", tokens)
    outcome = receiver.wait_outcome("r", 10.0)
    assert outcome is not None and outcome.ok
    tier = pd_tier(engine)
    assert tier.counters.corrupt == 0
    entry = tier._index[spans[1].key]  # the second chunk's page: a stray write lands there
    tier.page_view(entry.page, 8).copy_(torch.arange(8, dtype=torch.uint8))
    with engine.request("r"):
        assert engine.lookup(tokens, "r").tokens == len(tokens)  # the index does not know yet
        kv = engine.retrieve(tokens, "r")
        assert kv.shape[2] == spans[0].end  # served up to the changed chunk, not beyond
        assert torch.equal(kv, fake_prefill(tokens)[:, :, : spans[0].end])
    assert tier.counters.corrupt == 1
    assert_all_free(engine)


@pytest.mark.parametrize("channel", ["tcp", "shm"])
def test_every_serve_copies_once_from_the_buffer_and_checks_what_it_copies(
    make_decoder: Callable[..., Decoder], channel: str
) -> None:
    """``retrieve_into`` a longer tensor (each chunk a strided view of it) serves PD chunks
    straight from the receive buffer, verifying as it copies: no CPU staging page is filled,
    and each retrieve checks the page again, so a page changed between two retrieves of the
    same request ends the second one's hit there (a staging copy would have hidden it)."""
    engine, receiver = make_decoder(channel, pages=8)
    tokens = request_tokens(3)
    spans = keychain().keys(tokens, include_partial=True)
    assert len(spans) >= 3
    with sender(channel, receiver.port) as tx:
        send_one(tx, "r", tokens)
    outcome = receiver.wait_outcome("r", 10.0)
    assert outcome is not None and outcome.ok
    tier = pd_tier(engine)
    cpu_pool = engine.tier("cpu").pool  # type: ignore[union-attr]
    expected = fake_prefill(tokens)
    with engine.request("r"):
        assert engine.lookup(tokens, "r").tokens == len(tokens)
        reserved = cpu_pool.used_pages  # the lookup's spare pages, one per PD chunk
        out = torch.zeros(2, SMALL_LAYOUT.num_layers, len(tokens) + 5, SMALL_LAYOUT.hidden)
        out = out.to(SMALL_LAYOUT.dtype)
        assert engine.retrieve_into(tokens, "r", out) == len(tokens)
        assert torch.equal(out[:, :, : len(tokens)], expected)
        assert out[:, :, len(tokens) :].count_nonzero() == 0  # nothing past the chunks
        assert tier.counters.hits == len(spans)
        # No page was filled: the bytes went from the buffer to out directly.
        assert cpu_pool.used_pages == reserved and cpu_pool.buffer.count_nonzero() == 0
        entry = tier._index[spans[1].key]
        tier.page_view(entry.page, 8).copy_(torch.arange(8, dtype=torch.uint8))
        out.zero_()
        assert engine.retrieve_into(tokens, "r", out) == spans[0].end
        assert torch.equal(out[:, :, : spans[0].end], expected[:, :, : spans[0].end])
        assert tier.counters.corrupt == 1
    assert_all_free(engine)
