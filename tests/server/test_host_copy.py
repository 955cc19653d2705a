"""The client's host copies (:mod:`kvtier.memory.host_copy`, tested there): made on kvtier's
own copy threads, not torch's OpenMP pool (whose spinning workers made several client
processes slower together than one alone)."""

from __future__ import annotations

import threading

import pytest
import torch

from kvtier.memory import host_copy
from tests.conftest import SMALL_LAYOUT, make_kv, make_tokens
from tests.server.server_helpers import InProcess, open_client


def test_a_client_copies_on_its_own_threads(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Store and retrieve through a server: every piece of both copies goes through
    ``copy_bytes`` (GIL-free, on the caller and the ``kvtier-copy`` helpers), and the bytes
    round-trip exactly."""
    threads: list[str] = []
    copy_bytes = host_copy.copy_bytes

    def recording(dst: object, src: object) -> None:
        threads.append(threading.current_thread().name)
        copy_bytes(dst, src)  # type: ignore[arg-type]

    monkeypatch.setattr(host_copy, "copy_bytes", recording)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # one helper beside the caller
    server = InProcess(str(tmp_path))
    try:
        client = open_client(server.url)
        try:
            tokens, kv = make_tokens(64, 3), make_kv(64, 3)
            assert client.store(tokens, kv) == 4
            stored = len(threads)
            assert stored == 4 * SMALL_LAYOUT.planes * SMALL_LAYOUT.num_layers
            out = torch.zeros_like(kv)
            assert client.lookup(tokens, "r").tokens == 64
            assert client.retrieve_into(tokens, "r", out) == 64
            client.end_request("r")
            assert torch.equal(out, kv)
            assert len(threads) == 2 * stored
            assert {name.split("_")[0] for name in threads} <= {"MainThread", "kvtier-copy"}
        finally:
            client.close()
    finally:
        server.close()
