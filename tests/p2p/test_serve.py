"""The serving end of a P2P pull sends each chunk straight from its CPU page (no copy out
first), releases the page when the send is done, and the puller's block-by-block check
agrees with the chunk checksum byte for byte."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import pytest
import torch

from kvtier import Engine
from kvtier.layout import KVLayout
from kvtier.p2p import protocol as wire
from kvtier.p2p.fetch import receive_checked
from kvtier.p2p.serve import FetchServer
from kvtier.pd.checksum import BLOCK_BYTES, checksum
from kvtier.storage.base import Tier
from kvtier.storage.cpu import CpuTier
from tests.conftest import SMALL_LAYOUT, make_kv, make_tokens, small_config


@dataclass
class Model:
    cpu: Tier
    layout: KVLayout
    page_bytes: int


def test_chunks_go_out_from_their_cpu_pages_without_a_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_copy(self: CpuTier, key: object, out: torch.Tensor) -> int | None:
        raise AssertionError("the serve copied a resident page out before sending it")

    monkeypatch.setattr(CpuTier, "get_into", no_copy)
    with Engine(small_config(), SMALL_LAYOUT, model_name="p2p-serve") as engine:
        tokens, kv = make_tokens(48, 7), make_kv(48, 7)
        assert engine.store(tokens, kv) == 3
        keys = [span.key for span in engine.request_keys(tokens).spans]
        cpu = engine.tier("cpu")
        assert isinstance(cpu, CpuTier)
        expected = [cpu.pool.page_bytes_view(cpu._index[k].page, cpu._index[k].nbytes).clone()
                    for k in keys]  # fmt: skip
        server, puller = socket.socketpair()
        puller.settimeout(10)  # a serve that failed ends the test, never hangs it
        served: list[int] = []
        model = Model(cpu, SMALL_LAYOUT, engine.chunk_bytes)
        deadline = time.monotonic() + 30
        thread = threading.Thread(
            target=lambda: served.append(
                FetchServer().serve(server, "t1", [*keys, b"\0" * 16], model, deadline)
            )
        )
        thread.start()
        try:
            for i, want in enumerate(expected):
                chunk = wire.recv(puller, None)
                assert isinstance(chunk, wire.Chunk) and chunk.index == i
                page = torch.zeros(chunk.nbytes, dtype=torch.uint8)
                assert receive_checked(puller, page, deadline) == chunk.checksum
                assert torch.equal(page, want)
            assert isinstance(wire.recv(puller, None), wire.Missing)  # a key never stored
            assert wire.recv(puller, None) == wire.Done("t1")
        finally:
            thread.join(10)
            server.close()
            puller.close()
        assert served == [3]
        assert engine.check_invariants() == []  # every read reference the serve took is back
        assert cpu.pool.free_pages == cpu.pool.num_pages - 3  # the 3 entries' pages, no more


@pytest.mark.parametrize("nbytes", [1, BLOCK_BYTES, 2 * BLOCK_BYTES + 12345])
def test_the_block_by_block_check_is_the_chunk_checksum(nbytes: int) -> None:
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    sender, receiver = socket.socketpair()
    thread = threading.Thread(target=lambda: sender.sendall(data.numpy().tobytes()))
    thread.start()
    try:
        out = torch.zeros(nbytes, dtype=torch.uint8)
        assert receive_checked(receiver, out, time.monotonic() + 30) == checksum(data)
        assert torch.equal(out, data)
    finally:
        thread.join(10)
        sender.close()
        receiver.close()
