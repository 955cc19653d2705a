"""A P2P node that holds chunks, for tests that talk to one node directly (no server): an
engine's CPU tier attached to it, what it stored and the keys that name it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from kvtier import Engine
from kvtier.p2p.node import P2PNode
from tests.conftest import SMALL_LAYOUT, make_kv, make_tokens, small_config

TOKEN = "a-fleet-secret-of-32-characters!"
TIMEOUT = 2.0  # blocking_timeout_secs


@dataclass
class Holding:
    node: P2PNode
    fingerprint: str  # Fingerprint.hex() of the engine's model
    keys: list[bytes]  # the chunks its CPU tier holds, announced by the node


@contextmanager
def holding_node(lease_secs: float, num_tokens: int = 64, seed: int = 90) -> Iterator[Holding]:
    """An open node on a free loopback port, following nobody, whose CPU tier holds the
    chunks of one prompt of ``num_tokens`` tokens."""
    node = P2PNode("127.0.0.1:0", [], token=TOKEN, lease_secs=lease_secs, timeout=TIMEOUT)
    with Engine(small_config(), SMALL_LAYOUT, model_name="p2p-holder") as engine:
        cpu = engine.tier("cpu")
        assert cpu is not None
        fingerprint = engine.fingerprint.hex()
        node.attach(fingerprint, cpu, SMALL_LAYOUT, engine.chunk_bytes)
        node.open()
        try:
            tokens = make_tokens(num_tokens, seed)
            stored = engine.store(tokens, make_kv(num_tokens, seed))
            keys = [span.key for span in engine.request_keys(tokens).spans]
            assert stored == len(keys) > 0
            yield Holding(node, fingerprint, keys)
        finally:
            node.close()
