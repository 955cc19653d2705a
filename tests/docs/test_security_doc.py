"""docs/security.md's port table lists every port a kvtier deployment opens, the KV event
port included, and the recipe that keeps that port private works with vLLM's own publisher."""

from __future__ import annotations

import re
import socket
import time
from pathlib import Path

import pytest

from .doc_blocks import ROOT, section


def _port_rows() -> dict[str, list[str]]:
    rows: dict[str, list[str]] = {}
    for line in (ROOT / "docs/security.md").read_text().splitlines():
        if line.startswith("| ") and not line.startswith("| Port ") and "---" not in line:
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            rows[cells[0]] = cells
    return rows


def test_port_table_lists_the_kv_event_port_with_its_exposure() -> None:
    (row,) = [cells for name, cells in _port_rows().items() if "KV events" in name]
    _, opened, listens, who, secret = row
    assert "enable_kv_cache_events" in opened
    assert "tcp://*:5557" in listens  # vLLM's default: every interface
    assert "token ids" in who
    assert "no authentication" in secret and "#the-kv-event-port" in secret
    recipe = section("docs/security.md", "## The KV event port")
    assert "nft add rule" in recipe and "NetworkPolicy" in recipe


def _listening(port: int) -> set[str]:
    """Local addresses of the TCP sockets listening on ``port`` (from /proc/net/tcp{,6})."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:
                if len(address) == 8:
                    found.add(socket.inet_ntop(socket.AF_INET, bytes.fromhex(address)[::-1]))
                else:
                    raw = b"".join(bytes.fromhex(address[i : i + 8])[::-1] for i in range(0, 32, 8))
                    found.add(socket.inet_ntop(socket.AF_INET6, raw))
    return found


def test_the_documented_private_event_endpoint_binds_one_address_in_vllms_publisher() -> None:
    """The recipe's endpoint form, on loopback and a free port, given to vLLM's own
    ZmqEventPublisher: it listens on 127.0.0.1 alone, and a subscriber there gets a batch."""
    recipe = section("docs/security.md", "## The KV event port")
    assert "tcp://[::ffff:127.0.0.1]:5557" in recipe
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    zmq = pytest.importorskip("zmq")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    publisher = kv_events.ZmqEventPublisher(0, endpoint=f"tcp://[::ffff:127.0.0.1]:{port}")
    subscriber = zmq.Context.instance().socket(zmq.SUB)
    try:
        assert _listening(port) == {"127.0.0.1"}
        subscriber.setsockopt(zmq.SUBSCRIBE, b"")
        subscriber.connect(f"tcp://127.0.0.1:{port}")
        batch = kv_events.KVEventBatch(ts=time.time(), events=[])
        deadline = time.monotonic() + 30
        while not subscriber.poll(200):  # a SUB joins late: publish until one arrives
            assert time.monotonic() < deadline, "no batch reached the subscriber"
            publisher.publish(batch)
        frames = subscriber.recv_multipart()
        assert len(frames) == 3  # (topic, seq, payload)
    finally:
        subscriber.close(linger=0)
        publisher.shutdown()
    assert re.search(r"tcp://\[::ffff:10\.0\.0\.5\]:5557", recipe)
