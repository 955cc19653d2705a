"""What a slow or hostile admin client can no longer do: hold a handler thread forever, take
every thread, or keep close() waiting; and a client going away prints no traceback."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from kvtier import Engine
from kvtier.admin.server import AdminServer
from tests.admin.client import call
from tests.waiting import wait_until

SLACK_S = 1.5  # scheduling margin on a busy 2-core machine


@pytest.fixture
def make_server(engine: Engine) -> Iterator[Callable[..., AdminServer]]:
    made: list[AdminServer] = []

    def make(**limits: float) -> AdminServer:
        made.append(AdminServer(engine, "127.0.0.1", 0, **limits).open())  # type: ignore[arg-type]
        return made[-1]

    yield make
    for server in made:
        server.close()


def handler_threads() -> int:
    """Admin request handlers running in this process (each holds one connection)."""
    return sum(t.name == "kvtier-admin-request" for t in threading.enumerate())


def slow_client(server: AdminServer) -> socket.socket:
    """A client that has sent a request line and one header, and is still 'typing'."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10.0)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    return sock


def dropped_within(sock: socket.socket, seconds: float, trickle: float = 0.2) -> bool:
    """Keep sending one header line every ``trickle`` s (each well within any per-read
    timeout); True when the server hangs up within ``seconds``."""
    deadline = time.monotonic() + seconds
    sock.settimeout(trickle)
    while time.monotonic() < deadline:
        try:
            sock.sendall(b"X-Slow: 1\r\n")
            if sock.recv(1) == b"":
                return True
        except TimeoutError:
            continue
        except (BrokenPipeError, ConnectionResetError):
            return True
    return False


def test_a_client_sending_a_header_line_at_a_time_is_dropped_at_the_request_deadline(
    make_server: Callable[..., AdminServer],
) -> None:
    timeout = 1.0
    server = make_server(request_timeout=timeout)
    sock = slow_client(server)
    start = time.monotonic()
    assert dropped_within(sock, timeout + 3 * SLACK_S)
    assert time.monotonic() - start < timeout + SLACK_S
    sock.close()
    assert call(server.url, "/health").status == 200  # others are served as before


def test_handlers_are_capped_and_the_rest_get_503_at_once(
    make_server: Callable[..., AdminServer],
) -> None:
    # The holders' deadline is past the slack: a request that waited for a handler to free
    # up instead of getting its 503 at once could not pass the bound.
    timeout = 2 * SLACK_S
    server = make_server(request_timeout=timeout, max_handlers=2)
    before = handler_threads()
    held = [slow_client(server) for _ in range(2)]
    wait_until(lambda: handler_threads() == before + 2, 10, "both clients to hold a handler")
    start = time.monotonic()
    reply = call(server.url, "/health")
    assert reply.status == 503 and "too many" in reply.json()["error"]
    assert time.monotonic() - start < SLACK_S
    for sock in held:  # the holders are dropped at their deadline, freeing the handlers
        assert dropped_within(sock, timeout + 3 * SLACK_S)
        sock.close()
    wait_until(lambda: call(server.url, "/health").status == 200, 5, "a handler to be free")


def test_close_returns_at_once_whatever_clients_hold(
    make_server: Callable[..., AdminServer], capfd: pytest.CaptureFixture[str]
) -> None:
    server = make_server(request_timeout=60.0)
    before = handler_threads()
    held = [slow_client(server) for _ in range(3)]
    wait_until(lambda: handler_threads() == before + 3, 10, "3 clients to hold a handler")
    closer = threading.Thread(target=server.close)
    start = time.monotonic()
    closer.start()
    closer.join(timeout=10.0)
    assert not closer.is_alive(), "close() waited on its clients"
    assert time.monotonic() - start < 2 * SLACK_S  # against a 60 s request deadline
    for sock in held:
        sock.close()
    assert "Traceback" not in capfd.readouterr().err


def test_a_client_resetting_mid_request_prints_no_traceback(
    make_server: Callable[..., AdminServer], capfd: pytest.CaptureFixture[str]
) -> None:
    server = make_server()
    before = handler_threads()
    for _ in range(3):
        sock = slow_client(server)
        wait_until(lambda: handler_threads() == before + 1, 10, "a handler reading the headers")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()  # an RST, not a FIN: the handler's read fails
        wait_until(lambda: handler_threads() == before, 10, "the handler to end on the reset")
    assert call(server.url, "/health").status == 200
    server.close()
    assert "Traceback" not in capfd.readouterr().err
