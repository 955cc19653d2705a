"""A pull from a peer that lies, stalls or goes away mid-stream: misses, never data, never a hang.

The peer here is a socket of this test speaking the P2P wire (a real kvtier node serves only
what its CPU tier holds, with the right checksum: it cannot be made to lie).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from kvtier.p2p import protocol as wire
from kvtier.p2p.fetch import Fetcher
from kvtier.pd.checksum import checksum
from kvtier.trust import handshake
from kvtier.trust.handshake import Credentials
from tests.conftest import SMALL_CHUNK, SMALL_LAYOUT

TOKEN = "a-fleet-secret-of-32-characters!"
PAYLOAD = SMALL_LAYOUT.payload_bytes(SMALL_CHUNK)
KEYS = [bytes([i]) * 16 for i in range(3)]

Behaviour = Callable[[socket.socket, wire.Fetch], None]


@pytest.fixture
def peer() -> Iterator[Callable[[Behaviour], str]]:
    """``peer(behaviour)``: a listening peer that handshakes, then hands each Fetch to
    ``behaviour``; returns its address."""
    listeners: list[socket.socket] = []

    def start(behaviour: Behaviour) -> str:
        listener = socket.create_server(("127.0.0.1", 0))
        listeners.append(listener)

        def serve() -> None:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(10)
                me = Credentials(wire.PROTOCOL, "liar", TOKEN, "p2p_auth_token")
                handshake.accept(conn, me, time.monotonic() + 10)
                msg = wire.recv(conn, None)
                assert isinstance(msg, wire.Fetch)
                behaviour(conn, msg)

        threading.Thread(target=serve, daemon=True).start()
        return f"127.0.0.1:{listener.getsockname()[1]}"

    yield start
    for listener in listeners:
        listener.close()


def payload(i: int) -> torch.Tensor:
    return torch.full((PAYLOAD,), i + 1, dtype=torch.uint8)


def send_chunk(conn: socket.socket, i: int, data: torch.Tensor, csum: int | None = None) -> None:
    csum = checksum(data) if csum is None else csum
    wire.send(conn, wire.Chunk(i, SMALL_CHUNK, PAYLOAD, csum), time.monotonic() + 10)
    conn.sendall(data.numpy().tobytes())


def pull(address: str, timeout: float = 5.0) -> tuple[list[int | None], Fetcher, torch.Tensor]:
    fetcher = Fetcher("me", TOKEN)
    pages = torch.zeros((len(KEYS), SMALL_LAYOUT.chunk_bytes(SMALL_CHUNK)), dtype=torch.uint8)
    items = [(key, pages[i]) for i, key in enumerate(KEYS)]
    got = fetcher.fetch(address, "fp", SMALL_LAYOUT, items, time.monotonic() + timeout)
    fetcher.close()
    return got, fetcher, pages


def test_an_honest_peer_fills_the_pages(peer: Callable[[Behaviour], str]) -> None:
    def honest(conn: socket.socket, fetch: wire.Fetch) -> None:
        for i in range(len(fetch.keys)):
            send_chunk(conn, i, payload(i))
        wire.send(conn, wire.Done(fetch.transfer_id), time.monotonic() + 10)

    got, fetcher, pages = pull(peer(honest))
    assert got == [SMALL_CHUNK] * 3
    for i in range(3):
        assert torch.equal(pages[i, :PAYLOAD], payload(i))
    assert fetcher.counters.chunks == 3 and fetcher.counters.failed == 0


def test_a_chunk_that_fails_its_checksum_is_a_miss(peer: Callable[[Behaviour], str]) -> None:
    def flips_a_byte(conn: socket.socket, fetch: wire.Fetch) -> None:
        send_chunk(conn, 0, payload(0))
        bad = payload(1)
        csum = checksum(bad)
        bad[PAYLOAD // 2] ^= 0xFF  # damaged after the sender computed its checksum
        send_chunk(conn, 1, bad, csum)
        send_chunk(conn, 2, payload(2))
        wire.send(conn, wire.Done(fetch.transfer_id), time.monotonic() + 10)

    got, fetcher, _ = pull(peer(flips_a_byte))
    assert got == [SMALL_CHUNK, None, SMALL_CHUNK]
    assert fetcher.counters.corrupt == 1


def test_a_chunk_gone_since_announced_is_a_miss(peer: Callable[[Behaviour], str]) -> None:
    def evicted(conn: socket.socket, fetch: wire.Fetch) -> None:
        send_chunk(conn, 0, payload(0))
        wire.send(conn, wire.Missing(1, "evicted since it was announced"), time.monotonic() + 10)
        send_chunk(conn, 2, payload(2))
        wire.send(conn, wire.Done(fetch.transfer_id), time.monotonic() + 10)

    got, fetcher, _ = pull(peer(evicted))
    assert got == [SMALL_CHUNK, None, SMALL_CHUNK]
    assert fetcher.counters.missing == 1


def test_a_chunk_of_the_wrong_size_ends_the_pull(peer: Callable[[Behaviour], str]) -> None:
    def oversized(conn: socket.socket, fetch: wire.Fetch) -> None:
        send_chunk(conn, 0, payload(0))
        past_the_page = wire.Chunk(1, SMALL_CHUNK, PAYLOAD * 4, 0)
        wire.send(conn, past_the_page, time.monotonic() + 10)
        time.sleep(1)

    got, fetcher, _ = pull(peer(oversized))
    assert got == [SMALL_CHUNK, None, None]  # what was verified stays, the rest are misses
    assert fetcher.counters.failed == 1


def test_a_peer_that_dies_mid_chunk_costs_the_rest(peer: Callable[[Behaviour], str]) -> None:
    def dies(conn: socket.socket, fetch: wire.Fetch) -> None:
        send_chunk(conn, 0, payload(0))
        wire.send(conn, wire.Chunk(1, SMALL_CHUNK, PAYLOAD, 0), time.monotonic() + 10)
        conn.sendall(payload(1).numpy().tobytes()[: PAYLOAD // 3])  # then the host is gone

    got, fetcher, _ = pull(peer(dies))
    assert got == [SMALL_CHUNK, None, None]
    assert fetcher.counters.failed == 1


def test_a_silent_peer_is_a_miss_at_the_deadline(peer: Callable[[Behaviour], str]) -> None:
    stop = threading.Event()

    def silent(conn: socket.socket, fetch: wire.Fetch) -> None:
        stop.wait(30)

    address = peer(silent)
    started = time.monotonic()
    got, fetcher, _ = pull(address, timeout=1.0)
    elapsed = time.monotonic() - started
    stop.set()
    assert got == [None] * 3
    assert 1.0 <= elapsed < 3.0
    assert fetcher.counters.failed == 1


def test_a_peer_that_trickles_its_payload_is_cut_off_at_the_pulls_deadline(
    peer: Callable[[Behaviour], str],
) -> None:
    """The deadline is the whole pull's, not each read's: 64 bytes every 50 ms keeps every
    read well inside any per-read timeout, and the pull still ends at its 1 s."""

    def trickle(conn: socket.socket, fetch: wire.Fetch) -> None:
        data = payload(0)
        wire.send(conn, wire.Chunk(0, SMALL_CHUNK, PAYLOAD, checksum(data)), time.monotonic() + 10)
        raw = data.numpy().tobytes()
        try:
            for start in range(0, len(raw), 64):
                conn.sendall(raw[start : start + 64])
                time.sleep(0.05)
        except OSError:
            return  # the puller hung up: what we want

    start = time.monotonic()
    got, fetcher, _ = pull(peer(trickle), timeout=1.0)
    assert time.monotonic() - start < 1.8
    assert got == [None, None, None] and fetcher.counters.failed == 1
