"""The test harness's redis-server starts on a port someone else took after it was picked."""

from __future__ import annotations

import socket

import pytest

from tests.redis_servers import PortTaken, RedisServer


def test_a_port_taken_after_it_was_picked_is_left_for_another() -> None:
    """The race xdist workers run: the port was free when picked, bound by another process
    before redis-server bound it. The first start moves on; a restart (clients know the port)
    says the port is taken instead."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = RedisServer()
        server.port = taken.getsockname()[1]  # as if another worker bound it since
        try:
            server.start()
            assert server.port != taken.getsockname()[1]
            with server.client() as client:
                assert client.ping()
            moved = server.port
            server.stop()
            taken_again = socket.socket()
            taken_again.bind(("127.0.0.1", moved))
            taken_again.listen()
            try:
                with pytest.raises(PortTaken, match=str(moved)):
                    server.start()
            finally:
                taken_again.close()
        finally:
            server.cleanup()
