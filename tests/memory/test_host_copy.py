"""Host copies on kvtier's own threads (:mod:`kvtier.memory.host_copy`): exact bytes whatever
the strides, contiguous pieces for ``copy_bytes`` (not torch's OpenMP ``copy_``), a caller that
never waits for a helper that has not started, and the engine's CPU tier store and retrieve
made that way."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvtier import Engine
from kvtier.config import Config
from kvtier.layout import KVLayout
from kvtier.memory import host_copy
from kvtier.memory.host_copy import PARALLEL_MIN_BYTES, PIECE_BYTES, HostCopies
from tests.conftest import make_tokens

# Chunks as large as a real model's, scaled down: 256 KiB per plane and layer.
BIG = KVLayout(num_layers=4, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
CHUNK = 128


@pytest.fixture
def copies() -> Iterator[HostCopies]:
    made = HostCopies(threads=3)
    made.open()
    yield made
    made.close()


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """(thread name, bytes) of every piece that goes through ``copy_bytes``."""
    seen: list[tuple[str, int]] = []
    copy_bytes = host_copy.copy_bytes

    def recording(dst: np.ndarray, src: np.ndarray) -> None:
        seen.append((threading.current_thread().name, dst.nbytes))
        copy_bytes(dst, src)

    monkeypatch.setattr(host_copy, "copy_bytes", recording)
    return seen


def test_copies_every_byte_into_a_strided_view(copies: HostCopies) -> None:
    src = torch.randn(2, 4, 16, 64).to(torch.bfloat16)
    out = torch.zeros(2, 4, 40, 64, dtype=torch.bfloat16)
    copies.run([(out[:, :, 8:24, :], src)])
    assert torch.equal(out[:, :, 8:24, :], src)
    assert not out[:, :, :8].any() and not out[:, :, 24:].any()  # nothing outside the view


def test_strided_or_converting_pairs_fall_back_to_torch(copies: HostCopies) -> None:
    src = torch.randn(2, 3, 64, 16).transpose(2, 3)  # rows not contiguous
    dst = torch.zeros(2, 3, 16, 64, dtype=torch.float64)  # another dtype: a conversion
    copies.run([(dst, src)])
    assert torch.equal(dst, src.to(torch.float64))
    same = torch.zeros(2, 3, 16, 64)  # same dtype, transposed source: torch's strided copy
    copies.run([(same, src)])
    assert torch.equal(same, src)


def test_a_copy_of_another_shape_is_refused(copies: HostCopies) -> None:
    with pytest.raises(ValueError, match="copy of"):
        copies.run([(torch.zeros(4, 4), torch.zeros(2, 8))])


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


def test_a_contiguous_copy_is_cut_into_pieces_shared_by_the_helpers(
    copies: HostCopies, recorded: list[tuple[str, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One flat 8 MiB copy (a tier's ``put`` of a page): pieces of ``PIECE_BYTES``, taken by
    the caller and the helpers at once, not one copy on one thread."""
    src = torch.randint(0, 256, (8 * PIECE_BYTES,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    gate = threading.Barrier(2, timeout=10)  # the first two pieces wait for each other
    taken = iter(range(1 << 20))
    record = host_copy.copy_bytes

    def meeting(dst_piece: np.ndarray, src_piece: np.ndarray) -> None:
        if next(taken) < 2:
            gate.wait()  # two workers hold a piece at the same time, or this times out
        record(dst_piece, src_piece)

    monkeypatch.setattr(host_copy, "copy_bytes", meeting)
    copies.run([(dst, src)])
    assert torch.equal(dst, src)
    assert len(recorded) == 8 and {n for _, n in recorded} == {PIECE_BYTES}
    assert len({name for name, _ in recorded}) >= 2


def test_a_small_copy_stays_on_the_caller(
    copies: HostCopies, recorded: list[tuple[str, int]]
) -> None:
    src = torch.randn(2, 4, 16, 64)  # 32 KiB: waking a helper would cost more
    assert src.numel() * 4 < PARALLEL_MIN_BYTES
    dst = torch.zeros_like(src)
    copies.run([(dst, src)])
    assert torch.equal(dst, src)
    assert {name for name, _ in recorded} == {threading.current_thread().name}


def test_the_caller_does_not_wait_for_a_helper_that_never_started() -> None:
    """Every helper busy with something else (another caller's copy): the caller copies
    every piece itself and returns, cancelling the helpers' queued turns."""
    copier = HostCopies(threads=2)
    copier.open()
    release = threading.Event()
    pool = copier._pool
    assert pool is not None
    busy = pool.submit(release.wait)  # the one helper, held
    src = torch.randint(0, 256, (4, 4, 256, 1024), dtype=torch.uint8)  # 4 MiB, many pieces
    dst = torch.zeros_like(src)
    done = threading.Event()

    def copy() -> None:
        copier.run([(dst, src)])
        done.set()

    caller = threading.Thread(target=copy, daemon=True)
    caller.start()
    try:
        assert done.wait(10), "the caller waited for a helper that never started"
        assert torch.equal(dst, src)
    finally:
        release.set()
        busy.result()
        caller.join(10)
        copier.close()


def test_the_shared_copier_is_one_per_process() -> None:
    assert host_copy.shared() is host_copy.shared()


def test_the_engine_stores_and_retrieves_host_kv_on_kvtier_copy_threads(
    recorded: list[tuple[str, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU tier's store and retrieve of host KV: each chunk's copy into its page and out
    of it goes through ``copy_bytes`` in contiguous pieces (one per plane and layer), on the
    caller and the ``kvtier-copy`` helpers, never as torch's strided ``copy_``; the bytes
    round-trip exactly."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # one helper beside the caller
    chunks = 4
    piece = CHUNK * BIG.hidden * 2  # bytes of one plane and layer of a chunk
    config = Config.load(
        env={},
        overrides={
            "chunk_size": CHUNK,
            "max_local_cpu_size": f"{chunks * BIG.chunk_bytes(CHUNK)}B",
        },
    )
    tokens = make_tokens(chunks * CHUNK, 7)
    kv = torch.randn(BIG.kv_shape(chunks * CHUNK)).to(BIG.dtype)
    with Engine(config, BIG, model_name="host-copy") as engine:
        assert engine.store(tokens, kv) == chunks
        stored = list(recorded)
        assert len(stored) == chunks * BIG.planes * BIG.num_layers
        assert {n for _, n in stored} == {piece}
        out = torch.zeros_like(kv)
        with engine.request("r"):
            assert engine.lookup(tokens, "r").tokens == chunks * CHUNK
            assert engine.retrieve_into(tokens, "r", out) == chunks * CHUNK
        assert torch.equal(out, kv)
        assert len(recorded) == 2 * len(stored)
        names = {name.split("_")[0] for name, _ in recorded}
        assert names <= {threading.current_thread().name, "kvtier-copy"}
