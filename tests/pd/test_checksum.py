"""The PD chunk checksum: one definition, whichever way it is computed (whole, fed in pieces,
fused with a copy on one or two threads, from a strided view; in C, or in Python where the
extension was built without xxhash.h), and it sees every byte. Every test runs both ways."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import xxhash

from kvtier.pd import checksum as checksum_module
from kvtier.pd.checksum import (
    BLOCK_BYTES,
    BlockHasher,
    CopyThreads,
    checksum,
    copy_with_checksum,
)
from tests.hosts import not_applicable

SIZES = [0, 3, BLOCK_BYTES - 1, BLOCK_BYTES, 2 * BLOCK_BYTES + 17, 5 * BLOCK_BYTES]


@pytest.fixture(autouse=True, params=["fused", "python"])
def hashing(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """``fused``: copy and hash in kvtier's C extension; ``python``: as on a machine without
    xxhash.h, streaming copies then python xxhash."""
    if request.param == "python":
        monkeypatch.setattr(checksum_module, "native_copy_hash", None)
    elif not checksum_module.FUSED:
        pytest.skip("kvtier's extension was built without xxhash.h")
    return str(request.param)


@pytest.fixture(scope="module")
def helper() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(1) as pool:
        yield pool


def data(nbytes: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.manual_seed(seed))


@pytest.mark.parametrize("nbytes", SIZES)
def test_the_checksum_is_the_documented_block_digest(nbytes: int) -> None:
    raw = data(nbytes).numpy().tobytes()
    blocks = [raw[i : i + BLOCK_BYTES] for i in range(0, len(raw), BLOCK_BYTES)]
    digests = b"".join(xxhash.xxh3_64_intdigest(b).to_bytes(8, "little") for b in blocks)
    assert checksum(data(nbytes)) == xxhash.xxh3_64_intdigest(digests)


@pytest.mark.parametrize("nbytes", [*SIZES, 9 * BLOCK_BYTES + 3])
@pytest.mark.parametrize("threads", [1, 2])
def test_copy_with_checksum_copies_exactly_and_agrees(
    nbytes: int, threads: int, helper: ThreadPoolExecutor
) -> None:
    src = data(nbytes, 1)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    pool = helper if threads == 2 else None
    digest = copy_with_checksum(dst, src, pool)
    assert torch.equal(dst, src) and digest == checksum(src)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_strided_chunk_of_a_longer_kv_tensor_is_copied_and_hashed_in_canonical_order(
    threads: int, helper: ThreadPoolExecutor
) -> None:
    kv = torch.randn(2, 4, 3000, 64, generator=torch.manual_seed(2)).to(torch.bfloat16)
    for start, end in ((0, 1024), (1024, 2048), (2900, 3000)):
        view = kv[:, :, start:end, :]
        dst = torch.zeros(view.numel() * 2, dtype=torch.uint8)
        digest = copy_with_checksum(dst, view, helper if threads == 2 else None)
        assert torch.equal(dst.view(torch.bfloat16).view(view.shape), view)
        assert digest == checksum(view.contiguous())


@pytest.mark.parametrize("threads", [1, 2])
def test_a_page_served_into_a_strided_view_of_a_longer_kv_tensor(
    threads: int, helper: ThreadPoolExecutor
) -> None:
    """The decoder's direction: a contiguous page copied into its rows of the caller's KV,
    hashed in the page's order (the sender's checksum), nothing outside the rows touched."""
    kv = torch.randn(2, 4, 3000, 64, generator=torch.manual_seed(5)).to(torch.bfloat16)
    for start, end in ((0, 1024), (1024, 2048), (2900, 3000)):
        page = kv[:, :, start:end, :].contiguous()
        out = torch.zeros(2, 4, 3100, 64, dtype=torch.bfloat16)
        view = out[:, :, start:end, :]
        digest = copy_with_checksum(view, page, helper if threads == 2 else None)
        assert torch.equal(view, page) and digest == checksum(page)
        assert out.count_nonzero() == page.count_nonzero()


def test_a_destination_that_cannot_take_the_bytes_without_a_copy_is_refused() -> None:
    page = torch.ones(2, 4, 16, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="shape"):
        copy_with_checksum(torch.zeros(2, 4, 17, 64, dtype=torch.bfloat16), page, None)
    transposed = torch.zeros(2, 4, 64, 16, dtype=torch.bfloat16).transpose(2, 3)
    with pytest.raises(ValueError, match="dst"):
        copy_with_checksum(transposed, page, None)


@pytest.mark.parametrize("piece", [1, 4095, BLOCK_BYTES // 3, BLOCK_BYTES, 3 * BLOCK_BYTES])
def test_pieces_of_any_size_give_the_same_checksum(piece: int, hashing: str) -> None:
    if hashing == "python":
        not_applicable("BlockHasher is Python either way: this would compare it with itself")
    src = data(3 * BLOCK_BYTES + 5, 3).numpy()
    hasher = BlockHasher()
    for start in range(0, len(src), piece):
        hasher.update(src[start : start + piece])
    assert hasher.intdigest() == checksum(torch.from_numpy(src))


@pytest.mark.parametrize("offset", [0, BLOCK_BYTES - 1, BLOCK_BYTES, 3 * BLOCK_BYTES + 4])
def test_a_flipped_byte_in_any_block_changes_the_checksum(offset: int) -> None:
    src = data(3 * BLOCK_BYTES + 5, 4)
    before = checksum(src)
    flipped = src.clone()
    flipped[offset] ^= 1
    assert checksum(flipped) != before


def test_two_blocks_swapped_change_the_checksum() -> None:
    src = data(2 * BLOCK_BYTES, 5).numpy()
    swapped = np.concatenate([src[BLOCK_BYTES:], src[:BLOCK_BYTES]])
    assert checksum(torch.from_numpy(swapped)) != checksum(torch.from_numpy(src))


def test_copy_threads_tries_both_modes_and_always_gives_the_checksum(
    helper: ThreadPoolExecutor,
) -> None:
    copier = CopyThreads(helper)
    src = data(3 * BLOCK_BYTES + 1, 6)
    for _ in range(4):
        dst = torch.zeros_like(src)
        assert copier.copy(dst, src) == checksum(src)
        assert torch.equal(dst, src)
    assert set(copier.measured()) == {True, False}  # one thread and two were both measured


def test_copy_threads_retries_the_slower_mode_only_once_its_sample_is_old(
    helper: ThreadPoolExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    copier = CopyThreads(helper)
    src = data(2 * BLOCK_BYTES, 7)
    for _ in range(2 * CopyThreads.WARMUP):  # each mode measured
        copier.copy(torch.zeros_like(src), src)
    rates = copier.measured()
    faster = rates[True] >= rates[False]
    monkeypatch.setattr(CopyThreads, "EXPLORE_SECONDS", 3600.0)
    assert [copier._choose() for _ in range(20)] == [faster] * 20
    monkeypatch.setattr(CopyThreads, "EXPLORE_SECONDS", 0.0)
    assert copier._choose() is (not faster)
