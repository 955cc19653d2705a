"""``kvtier bench p2p``: a P2P pull between two servers' nodes vs a raw socket, same bytes.

Server A's side is a real engine whose CPU tier a :class:`~kvtier.p2p.node.P2PNode` announces
and serves; B's is another node that follows A and reads through its p2p tier, exactly as a
``kvtier server``'s engine does on a local miss (``get_many_into`` into pages: the handshake
once per connection, a Fetch per pull, each chunk read out of A's CPU tier into a scratch
page, checksummed, sent, received straight into B's page and checked). On loopback here;
across hosts the network sets the pace.

- ``pull_gbps``: the chunks' bytes over the pull's wall time (median of ``--repeats``);
- ``raw_gbps``: the same bytes in the same pieces over one loopback TCP connection, received
  into the same pages (nothing read out of a tier, nothing checksummed): the floor;
- ``ratio``: pull over raw, the median of ``--repeats`` alternating pull/raw pairs
  (:func:`kvtier.bench.timing.alternate`), ``ratio_min`` / ``ratio_max`` the lowest and
  highest pair; ``load_1m`` the host's load average when it ended.
"""

from __future__ import annotations

import argparse
import secrets
import socket
import threading
import time
from typing import Any

import torch

from kvtier.bench.checks import require
from kvtier.bench.timing import alternate, host_load
from kvtier.config import Config
from kvtier.engine import Engine
from kvtier.layout import KVLayout
from kvtier.p2p.node import P2PNode

LAYOUT = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chunks", type=int, default=16, help="chunks per pull")
    parser.add_argument("--chunk-size", type=int, default=64, help="tokens (64: 8 MiB chunks)")
    parser.add_argument(
        "--repeats", type=int, default=9, help="pull/raw-socket pairs; their median is reported"
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    chunk_bytes = LAYOUT.chunk_bytes(args.chunk_size)
    tokens = args.chunks * args.chunk_size
    config = Config.load(
        env={},
        overrides={
            "chunk_size": args.chunk_size,
            "max_local_cpu_size": f"{(args.chunks + 1) * chunk_bytes}B",
        },
    )
    token = secrets.token_urlsafe(32)
    a = P2PNode("127.0.0.1:0", [], token=token, lease_secs=3.0, timeout=60.0).open()
    engine = Engine(config, LAYOUT, model_name="bench-p2p").open()
    b: P2PNode | None = None
    try:
        cpu = engine.tier("cpu")
        require(cpu is not None, "the engine has no CPU tier")
        assert cpu is not None
        fp = engine.fingerprint.hex()
        a.attach(fp, cpu, LAYOUT, engine.chunk_bytes)
        prompt = torch.arange(tokens, dtype=torch.int32)
        kv = torch.randn(LAYOUT.kv_shape(tokens)).to(LAYOUT.dtype)
        require(engine.store(prompt, kv) == args.chunks, "the prompt's chunks were not stored")
        keys = [s.key for s in engine.request_keys(prompt).spans]
        b = P2PNode("127.0.0.1:0", [a.address], token=token, lease_secs=3.0, timeout=60.0)
        b.open()
        deadline = time.monotonic() + 30
        while None in b.directory.holders(fp, keys):
            require(time.monotonic() < deadline, "B never heard of A's chunks")
            time.sleep(0.01)
        tier = b.tier(fp, LAYOUT)
        pages = torch.empty((args.chunks, chunk_bytes), dtype=torch.uint8)
        pages.fill_(0)  # touched once: first-touch costs are not the pull's
        items = [(key, pages[i]) for i, key in enumerate(keys)]

        def pull() -> None:
            got = tier.get_many_into(items)
            require(None not in got, f"a pull missed: {got}")

        raw = _RawSocket(chunk_bytes, args.chunks)
        try:
            rounds = alternate({"pull": pull, "raw": lambda: raw.receive(pages)}, args.repeats)
        finally:
            raw.close()
        expected = torch.empty(chunk_bytes, dtype=torch.uint8)
        require(cpu.get_into(keys[0], expected) is not None, "chunk 0 left A")
        tier.get_many_into(items[:1])
        require(torch.equal(pages[0], expected), "the pulled bytes differ from A's")
    finally:
        if b is not None:
            b.close()
        a.close()
        engine.close()
    nbytes = args.chunks * LAYOUT.payload_bytes(args.chunk_size)
    return {
        "chunks": args.chunks,
        "chunk_bytes": chunk_bytes,
        "bytes": nbytes,
        "pull_gbps": round(rounds.gbps("pull", nbytes), 3),
        "raw_gbps": round(rounds.gbps("raw", nbytes), 3),
        **rounds.ratio("pull", "raw").fields("ratio"),
        "pairs": args.repeats,
        **host_load(),
    }


class _RawSocket:
    """One loopback TCP connection; each ``receive`` asks the sender for ``count`` pieces of
    ``nbytes`` and receives them into the pages."""

    def __init__(self, nbytes: int, count: int) -> None:
        self.nbytes, self.count = nbytes, count
        listener = socket.create_server(("127.0.0.1", 0))
        self.sock = socket.create_connection(listener.getsockname())
        self.peer, _ = listener.accept()
        listener.close()
        self.payload = memoryview(bytearray(b"\x5a" * nbytes))
        self.thread = threading.Thread(target=self._send, daemon=True)
        self.thread.start()

    def _send(self) -> None:
        try:
            while self.peer.recv(1):
                for _ in range(self.count):
                    self.peer.sendall(self.payload)
        except OSError:
            return  # closed: the bench is over

    def receive(self, pages: torch.Tensor) -> None:
        self.sock.sendall(b"g")
        for i in range(self.count):
            view = memoryview(pages[i].numpy())  # type: ignore[arg-type]
            got = 0
            while got < self.nbytes:
                got += self.sock.recv_into(view[got:], self.nbytes - got)

    def close(self) -> None:
        self.sock.close()
        self.peer.close()
        self.thread.join(5)
