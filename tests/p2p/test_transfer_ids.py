"""A transfer id is single use: a node serves a Fetch of an id once, and refuses it after
that (no chunk sent), on the same connection or another. A puller that replays a pull, or
two pullers that pick the same id, never get a chunk twice under one id.

The dialing is in :func:`dial` alone: the one place to adapt when the handshake changes.
"""

from __future__ import annotations

import socket
import time

from kvtier.errors import TransferError, TransferTimeout
from kvtier.framing import recv_exact
from kvtier.p2p import protocol as wire
from kvtier.p2p.node import P2PNode
from kvtier.trust.dial import connect
from kvtier.trust.handshake import Credentials
from tests.p2p.node_helpers import TIMEOUT, TOKEN, Holding, holding_node
from tests.server.server_helpers import wait_until

LEASE = 1.0


def dial(node: P2PNode) -> socket.socket:
    """A puller's connection to ``node``'s P2P port, past the real handshake."""
    me = Credentials(wire.PROTOCOL, "test-puller", TOKEN, "p2p_auth_token")
    sock, _ = connect("127.0.0.1", node.port, me, time.monotonic() + TIMEOUT, "the P2P node")
    return sock


def pull(sock: socket.socket, held: Holding, transfer_id: str) -> list[str]:
    """Fetch every key ``held`` names under ``transfer_id``: what came back, in order, of
    "chunk", "missing", "done" and "closed" (the node ended the connection)."""
    deadline = time.monotonic() + TIMEOUT
    wire.send(sock, wire.Fetch(held.fingerprint, transfer_id, held.keys), deadline)
    got: list[str] = []
    while True:
        try:
            msg = wire.recv(sock, deadline)
        except TransferTimeout:
            raise
        except TransferError:  # reset: as closed
            msg = None
        match msg:
            case None:
                return [*got, "closed"]
            case wire.Chunk(nbytes=nbytes):
                recv_exact(sock, memoryview(bytearray(nbytes)), deadline)
                got.append("chunk")
            case wire.Missing():
                got.append("missing")
            case wire.Done():
                return [*got, "done"]
            case _:
                raise AssertionError(f"unexpected {type(msg).__name__} in a pull")


def test_a_transfer_id_is_served_once_and_refused_after() -> None:
    with holding_node(LEASE) as held:
        node, n = held.node, len(held.keys)
        first = dial(node)
        try:
            assert pull(first, held, "t-1") == ["chunk"] * n + ["done"]
            # counted just after the Done is sent
            wait_until(lambda: node.served_chunks == n, what="the first pull counted")
            replayed = pull(first, held, "t-1")  # the same id on the same connection
        finally:
            first.close()
        assert "chunk" not in replayed, replayed
        with dial(node) as other:  # ... or on another: the node remembers it, not the socket
            elsewhere = pull(other, held, "t-1")
        assert "chunk" not in elsewhere, elsewhere
        with dial(node) as fresh:  # the refusal is of the id, not of the puller
            assert pull(fresh, held, "t-2") == ["chunk"] * n + ["done"]
        wait_until(lambda: node.served_chunks == 2 * n, what="the fresh pull counted, only it")
