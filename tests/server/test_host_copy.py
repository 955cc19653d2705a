"""The client's host copies (:mod:`kvtier.server.host_copy`): exact bytes whatever the
strides, and made on kvtier's own copy threads, not torch's OpenMP pool (whose spinning
workers made several client processes slower together than one alone)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from kvtier.server import host_copy
from kvtier.server.host_copy import HostCopies
from tests.conftest import SMALL_LAYOUT, make_kv, make_tokens
from tests.server.server_helpers import InProcess, open_client


@pytest.fixture
def copies() -> Iterator[HostCopies]:
    made = HostCopies(threads=3)
    made.open()
    yield made
    made.close()


def test_copies_every_byte_into_a_strided_view(copies: HostCopies) -> None:
    src = torch.randn(2, 4, 16, 64).to(torch.bfloat16)
    out = torch.zeros(2, 4, 40, 64, dtype=torch.bfloat16)
    copies.run([(out[:, :, 8:24, :], src)])
    assert torch.equal(out[:, :, 8:24, :], src)
    assert not out[:, :, :8].any() and not out[:, :, 24:].any()  # nothing outside the view


def test_strided_or_converting_pieces_fall_back_to_torch(copies: HostCopies) -> None:
    src = torch.randn(2, 3, 64, 16).transpose(2, 3)  # rows not contiguous
    dst = torch.zeros(2, 3, 16, 64, dtype=torch.float64)  # another dtype: a conversion
    copies.run([(dst, src)])
    assert torch.equal(dst, src.to(torch.float64))


def test_an_unopened_or_closed_copier_copies_on_the_caller() -> None:
    copier = HostCopies(threads=2)
    src = torch.arange(2 * 2 * 8 * 4, dtype=torch.float32).reshape(2, 2, 8, 4)
    dst = torch.zeros_like(src)
    copier.run([(dst, src)])
    copier.open()
    copier.close()
    copier.close()  # idempotent
    dst2 = torch.zeros_like(src)
    copier.run([(dst2, src)])
    assert torch.equal(dst, src) and torch.equal(dst2, src)


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
