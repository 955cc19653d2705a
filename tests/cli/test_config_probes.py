"""The probes of ``kvtier check-config`` keep the time they promise, whole: a Redis that
accepts a connection and never answers (a stopped server, a port a proxy holds open) ends
the probe at its deadline with the address named, one node or a cluster URL of many, where
redis-py's default retries made it 27 s for one node and 212 s for eight."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from kvtier.cli.config_probes import REDIS_TIMEOUT_S, probe_all, probe_redis
from kvtier.config import Config
from tests.redis_servers import RedisServer

SLACK_S = 0.5  # thread start and the close at the deadline, on a loaded 2-core machine


class SilentNode:
    """A real TCP listener on loopback that accepts every connection and never sends a byte
    (nor reads one): to a client, a Redis that hangs after the handshake."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.listener.settimeout(0.05)  # the accept loop looks at ``stopped`` this often
        self.port: int = self.listener.getsockname()[1]
        self.held: list[socket.socket] = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.stopped.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            self.held.append(conn)  # kept open, unread, unanswered

    def close(self) -> None:
        self.stopped.set()
        self.thread.join()
        self.listener.close()
        for conn in self.held:
            conn.close()


@pytest.fixture
def silent_nodes() -> Iterator[Callable[[int], list[SilentNode]]]:
    made: list[SilentNode] = []

    def make(count: int) -> list[SilentNode]:
        nodes = [SilentNode() for _ in range(count)]
        made.extend(nodes)
        return nodes

    yield make
    for node in made:
        node.close()


def timed_probe(url: str, timeout: float) -> tuple[float, str]:
    started = time.monotonic()
    error = probe_redis(url, timeout)
    elapsed = time.monotonic() - started
    assert error is not None
    return elapsed, str(error)


def test_one_silent_node_ends_the_probe_at_its_deadline_naming_it(
    silent_nodes: Callable[[int], list[SilentNode]],
) -> None:
    (node,) = silent_nodes(1)
    elapsed, error = timed_probe(f"redis://127.0.0.1:{node.port}/0", 1.0)
    assert elapsed < 1.0 + SLACK_S, elapsed
    assert f"127.0.0.1:{node.port}: " in error
    assert "a Redis that answers PING within 1 s" in error
    assert node.held, "the node accepted the probe's connection"


def test_a_cluster_url_of_silent_nodes_shares_one_deadline(
    silent_nodes: Callable[[int], list[SilentNode]],
) -> None:
    nodes = silent_nodes(8)
    url = "redis-cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in nodes)
    elapsed, error = timed_probe(url, 1.0)
    assert elapsed < 1.0 + SLACK_S, elapsed
    for node in nodes:
        assert f"127.0.0.1:{node.port}: " in error


def test_check_configs_probe_keeps_its_promised_bound(
    silent_nodes: Callable[[int], list[SilentNode]],
) -> None:
    """Through :func:`probe_all`, as check-config runs it: the promise is REDIS_TIMEOUT_S."""
    nodes = silent_nodes(3)
    url = "redis-cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in nodes)
    started = time.monotonic()
    found = probe_all(Config(remote_url=url))
    ((what, error),) = [(w, e) for w, e in found if w.startswith("remote_url")]
    elapsed = time.monotonic() - started
    assert elapsed < REDIS_TIMEOUT_S + SLACK_S, elapsed
    assert what.startswith("remote_url: PING") and error is not None
    assert error.key == "remote_url" and f"127.0.0.1:{nodes[2].port}" in str(error)


def test_a_cluster_answers_through_a_live_node_behind_silent_ones(
    silent_nodes: Callable[[int], list[SilentNode]], redis_server: RedisServer
) -> None:
    """Every node is tried at once: silent nodes listed first do not eat the live one's time."""
    nodes = silent_nodes(2)
    listed = [f"127.0.0.1:{n.port}" for n in nodes] + [f"127.0.0.1:{redis_server.port}"]
    started = time.monotonic()
    assert probe_redis("redis-cluster://" + ",".join(listed), REDIS_TIMEOUT_S) is None
    assert time.monotonic() - started < REDIS_TIMEOUT_S / 2
