"""What one connection may hold: whole-frame deadlines (a Hello or a request trickled a byte
at a time does not keep a slot).

The servers run in this process (``make_server``): real sockets and threads, seconds saved.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest

from kvtier.server import handler
from kvtier.server import protocol as wire
from tests.conftest import make_kv, make_tokens
from tests.server.server_helpers import (
    open_client,
    wait_until,
)

PAGES = 16  # make_server's default CPU tier
SHARE = PAGES // 2  # server_client_pin_share 0.5


def packed(tokens: list[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}i", *tokens)


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """True once the server closed its end (EOF or a reset) within ``seconds``."""
    sock.settimeout(seconds)
    try:
        while sock.recv(1 << 16):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


@pytest.fixture
def trickle() -> Iterator[object]:
    """``trickle(sock, data)``: send ``data`` one byte every 0.2 s on a thread, until all is
    sent or the server hangs up."""
    stop = threading.Event()
    threads: list[threading.Thread] = []

    def send_slowly(sock: socket.socket, data: bytes) -> None:
        for i in range(len(data)):
            if stop.wait(0.2):
                return
            try:
                sock.send(data[i : i + 1])
            except OSError:
                return

    def start(sock: socket.socket, data: bytes) -> None:
        thread = threading.Thread(target=send_slowly, args=(sock, data), daemon=True)
        thread.start()
        threads.append(thread)

    yield start
    stop.set()
    for thread in threads:
        thread.join(5)


# -- 5: deadlines for whole frames, not per recv ---------------------------------------------
def test_a_hello_trickled_a_byte_at_a_time_loses_its_slot_at_the_hello_deadline(
    make_server: object, trickle: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two clients that each send a byte of their Hello every 0.2 s (each recv gets a byte
    well within any per-recv timeout) must not lock everyone out of a 2-client server."""
    monkeypatch.setattr(handler, "HELLO_TIMEOUT_S", 1.0)
    proc = make_server(server_max_clients=2)  # type: ignore[operator]
    with open_client(proc.url) as probe:
        hello = wire.encode(probe._link.hello)
    slow = []
    for _ in range(2):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(proc.path)
        trickle(sock, hello)  # type: ignore[operator]
        slow.append(sock)
    wait_until(lambda: len(proc.server.sessions) == 2, what="the slow clients admitted")
    started = time.monotonic()
    assert all(closed_within(sock, 5.0) for sock in slow)
    assert time.monotonic() - started < 4.0
    wait_until(lambda: len(proc.server.sessions) == 0, what="their slots given back")
    with open_client(proc.url) as client:
        assert client.connected
    for sock in slow:
        sock.close()


def test_a_request_trickled_after_the_hello_is_closed_at_the_frame_deadline(
    make_server: object, trickle: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(wire, "STALL_TIMEOUT_S", 1.0)
    proc = make_server()  # type: ignore[operator]
    client = open_client(proc.url)
    tokens = make_tokens(64, 3)
    client.store(tokens, make_kv(64, 3))
    assert client.lookup(tokens, "held") == 64  # something its connection must give back
    sock = client._link.sock
    assert sock is not None
    trickle(sock, wire.encode(wire.Lookup("slow", packed(tokens))))  # type: ignore[operator]
    started = time.monotonic()
    assert closed_within(sock, 5.0)
    assert time.monotonic() - started < 4.0
    client.close()
    with open_client(proc.url) as other:
        wait_until(lambda: other.stats()["open_requests"] == 0, what="its request released")
        assert other.check_invariants() == []
