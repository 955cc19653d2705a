"""Pulled transfers (xPyD) on real sockets: a prefiller's PDSource holds requests' chunks,
a decoder pulls the one its request names; single use, bound to the prompt's keys (salt),
authenticated, freed by TTL when no decoder comes, and a prefiller killed mid-pull (a real
process) leaves the decoder prefilling, never hanging, holding nothing."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from kvtier import Engine
from kvtier.keys import ChunkKey, ChunkSpan
from kvtier.pd.puller import Puller
from kvtier.pd.receiver import PDReceiver
from kvtier.pd.source import PDSource
from tests.conftest import SMALL_LAYOUT, small_config
from tests.pd.pd_helpers import (
    PAGE_BYTES,
    assert_all_free,
    decoder,
    fake_prefill,
    keychain,
    request_tokens,
)

SPAWN = multiprocessing.get_context("spawn")
TOKEN = "a-shared-secret-of-32-characters"


def wait_until(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def source(channel: str = "tcp", pages: int = 8, ttl: float = 120.0, **over: object) -> PDSource:
    cfg = small_config(
        enable_pd=True,
        pd_role="sender",
        pd_buffer_size=f"{pages * PAGE_BYTES + PAGE_BYTES // 2}B",  # a ceiling: 8 pages
        transfer_channel=channel,
        save_unfull_chunk=True,
        pd_reservation_ttl_sec=ttl,
        **over,
    )
    return PDSource.from_config(cfg, SMALL_LAYOUT, keychain().fingerprint.hex()).open()


def spans_of(tokens: list[int], salt: str | None = None) -> list[ChunkSpan]:
    return list(keychain().keys(tokens, include_partial=True, salt=salt))


def keys_of(tokens: list[int], salt: str | None = None) -> list[ChunkKey]:
    return [s.key for s in spans_of(tokens, salt)]


def hold(src: PDSource, tid: str, tokens: list[int], salt: str | None = None) -> int:
    return src.hold(tid, spans_of(tokens, salt), fake_prefill(tokens))


@pytest.fixture
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[PDSource, Engine, PDReceiver]]:
    channel = getattr(request, "param", "tcp")
    src = source(channel)
    engine, receiver = decoder(channel, pages=8)
    try:
        yield src, engine, receiver
    finally:
        receiver.close()
        engine.close()
        src.close()


@pytest.mark.parametrize("pair", ["tcp", "shm"], indirect=True)
def test_decoders_pull_what_the_prefiller_held_byte_for_byte(
    pair: tuple[PDSource, Engine, PDReceiver],
) -> None:
    src, engine, receiver = pair
    puller = Puller(receiver)
    host, port = src.address
    a, b = request_tokens(0), request_tokens(4)  # same system prompt: 2 chunks shared
    assert hold(src, "ta", a) == len(spans_of(a))
    assert hold(src, "tb", b) == len(spans_of(b))
    assert src.buffer.counters.shared_chunks == 2  # b's prefix: a reference, no copy
    assert src.buffer.check_invariants() == []
    for tid, tokens, rid in (("ta", a, "ra"), ("tb", b, "rb")):
        outcome = puller.pull(host, port, tid, keys_of(tokens))
        assert outcome.ok, outcome.reason
        assert engine.lookup(tokens, rid).tokens == len(tokens)
        assert torch.equal(engine.retrieve(tokens, rid), fake_prefill(tokens))
        engine.end_request(rid)
        engine.end_request(tid)  # the transfer's lease (the decoder's request end does it)
    assert_all_free(engine)
    # Single use: served transfers are gone from the prefiller, their pages free (its serving
    # thread ends the transfer right after the decoder's DoneReply).
    assert wait_until(lambda: src.buffer.stats()["used_bytes"] == 0, 5.0)
    assert src.buffer.check_invariants() == []
    again = puller.pull(host, port, "ta", keys_of(a))
    assert not again.ok and "unknown" in again.reason
    assert puller.pulls == 3 and len(puller._idle[(host, port)]) == 1  # one connection reused
    puller.close()


def test_a_claim_is_bound_to_the_prompts_salt_and_a_wrong_one_leaves_it_held(
    pair: tuple[PDSource, Engine, PDReceiver],
) -> None:
    src, engine, receiver = pair
    puller = Puller(receiver)
    tokens = request_tokens(1)
    hold(src, "t", tokens, salt="tenant-a")
    wrong = puller.pull(*src.address, "t", keys_of(tokens, salt="tenant-b"))
    assert not wrong.ok and "mismatch" in wrong.reason
    assert src.buffer.transfer("t") is not None  # the right decoder may still come
    right = puller.pull(*src.address, "t", keys_of(tokens, salt="tenant-a"))
    assert right.ok
    assert engine.lookup(tokens, "r", cache_salt="tenant-a").tokens == len(tokens)
    engine.end_request("r")
    engine.end_request("t")
    assert_all_free(engine)
    puller.close()


def test_the_pd_port_stays_authenticated() -> None:
    src = source(pd_auth_token=TOKEN)
    engine, receiver = decoder("tcp", pages=8, pd_auth_token="another-secret-of-32-characters!")
    try:
        tokens = request_tokens(2)
        hold(src, "t", tokens)
        outcome = Puller(receiver).pull(*src.address, "t", keys_of(tokens))
        assert not outcome.ok and "pd_auth_token" in outcome.reason
        assert src.buffer.transfer("t") is not None  # no claim reached it
        assert receiver.auth_failures == 1  # counted where it is seen, on the decoder
        assert_all_free(engine)
    finally:
        receiver.close()
        engine.close()
    engine, receiver = decoder("tcp", pages=8, pd_auth_token=TOKEN)
    try:
        assert Puller(receiver).pull(*src.address, "t", keys_of(tokens)).ok
        engine.end_request("t")
        assert_all_free(engine)
    finally:
        receiver.close()
        engine.close()
        src.close()


def test_a_transfer_no_decoder_claims_is_freed_after_the_ttl() -> None:
    src = source(ttl=0.3)
    try:
        hold(src, "lost", request_tokens(3))
        assert src.buffer.stats()["used_bytes"] > 0
        deadline = time.monotonic() + 5
        while src.buffer.stats()["used_bytes"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert src.buffer.stats()["used_bytes"] == 0 and src.buffer.counters.expired == 1
        assert src.buffer.check_invariants() == []
    finally:
        src.close()


def test_a_full_send_buffer_holds_a_prefix_and_never_blocks() -> None:
    src = source(pages=3)
    try:
        tokens = request_tokens(49)  # 12 chunks
        started = time.monotonic()
        assert hold(src, "big", tokens) == 3
        assert time.monotonic() - started < 1.0
        assert hold(src, "big", tokens) == 0  # cut short: nothing after the gap
        assert src.buffer.counters.truncated == 1
    finally:
        src.close()


def run_stalling_source(port: object, ready: object, full_chunks: int) -> None:
    """Process entry: a prefiller that accepts one pull, sends ``full_chunks`` chunks whole
    and half of the next, then hangs until killed."""
    import socket as socket_mod

    from kvtier.pd.channels.tcp import TcpSender
    from kvtier.pd.protocol import (
        PULL,
        AllocReply,
        AllocRequest,
        ChunkSent,
        Pull,
        recv_message,
        send_message,
    )
    from kvtier.pd.source import source_identity
    from kvtier.trust import handshake
    from kvtier.trust.handshake import Credentials
    from tests.pd.pd_helpers import sender

    listener = socket_mod.create_server(("127.0.0.1", 0))
    port.put(listener.getsockname()[1])  # type: ignore[attr-defined]
    conn, _ = listener.accept()
    host, bound = listener.getsockname()[:2]
    me = Credentials(PULL, source_identity(host, bound, "stalling"), None, "pd_auth_token")
    handshake.accept(conn, me, time.monotonic() + 10.0)
    tx = sender("tcp", 0).adopt(conn, "the test decoder")
    pull = recv_message(conn)
    assert isinstance(pull, Pull)
    tokens = request_tokens(49, 7)
    spans = keychain().keys(tokens, include_partial=True)
    kv = fake_prefill(tokens)
    send_message(
        conn, AllocRequest(pull.request_id, [s.key for s in spans], [s.num_tokens for s in spans])
    )
    reply = recv_message(conn)
    assert isinstance(reply, AllocReply)
    out = TcpSender()
    for i in range(full_chunks):
        out.send_chunk(
            conn, pull.request_id, i, reply.pages[i], kv[:, :, spans[i].start : spans[i].end, :]
        )
    nbytes = spans[full_chunks].num_tokens * SMALL_LAYOUT.token_bytes()
    send_message(conn, ChunkSent(pull.request_id, full_chunks, nbytes, 0))
    conn.sendall(b"\0" * (nbytes // 2))
    assert tx is not None
    ready.set()  # type: ignore[attr-defined]
    signal.pause()


def test_a_prefiller_killed_mid_pull_leaves_the_decoder_prefilling_holding_nothing() -> None:
    engine, receiver = decoder("tcp", pages=16, pd_message_timeout_sec=30.0)
    ports, ready = SPAWN.Queue(), SPAWN.Event()
    proc = SPAWN.Process(target=run_stalling_source, args=(ports, ready, 3))
    proc.start()
    try:
        port = ports.get(timeout=60)
        tokens = request_tokens(49, 7)
        result: list[object] = []

        import threading

        thread = threading.Thread(
            target=lambda: result.append(
                Puller(receiver).pull("127.0.0.1", port, "t", keys_of(tokens))
            )
        )
        thread.start()
        assert ready.wait(60)
        assert engine.stats()["tiers"]["pd"]["used_bytes"] > 0  # mid-transfer: reserved
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGKILL)
        started = time.monotonic()
        thread.join(20)
        assert not thread.is_alive() and time.monotonic() - started < 10  # no hang
        outcome = result[0]
        assert not outcome.ok  # type: ignore[attr-defined]
        # Nothing of it is served (never a wrong byte): the decoder prefills all of it.
        assert engine.lookup(tokens, "r").tokens == 0
        engine.end_request("r")
        engine.end_request("t")
        assert_all_free(engine)
    finally:
        if proc.is_alive() and proc.pid is not None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        receiver.close()
        engine.close()


def test_a_decoder_connection_idle_past_the_message_deadline_serves_the_next_pull() -> None:
    """Between pulls the prefiller waits pd_idle_timeout_sec, not pd_message_timeout_sec: the
    decoder's kept connection still serves its next pull."""
    src = source(pd_message_timeout_sec=0.3)
    engine, receiver = decoder("tcp", pages=8, pd_message_timeout_sec=0.3)
    try:
        puller = Puller(receiver)
        first, second = request_tokens(0), request_tokens(1)
        hold(src, "t1", first)
        hold(src, "t2", second)
        assert puller.pull(*src.address, "t1", keys_of(first)).ok
        [kept] = puller._idle[src.address]
        time.sleep(0.8)  # past the message deadline on both sides
        assert puller.pull(*src.address, "t2", keys_of(second)).ok
        assert puller._idle[src.address] == [kept]  # the same connection, reused
        for rid in ("t1", "t2"):
            engine.end_request(rid)
        assert_all_free(engine)
        puller.close()
    finally:
        receiver.close()
        engine.close()
        src.close()
