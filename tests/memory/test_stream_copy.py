"""Streaming-store copies: byte-exact at any alignment and size, refused when sizes differ,
and built on every machine the project's own set-up installs (a C compiler is there)."""

from __future__ import annotations

import itertools
import sys
import threading
from collections.abc import Callable

import numpy as np
import pytest
import xxhash

from kvtier.memory import stream_copy
from kvtier.memory.stream_copy import STREAM_MIN_BYTES, copy_bytes


def test_the_extension_is_built_where_make_installs_kvtier() -> None:
    # A silent fallback would leave the fast path untested: the Makefile's install compiles
    # it (gcc and the Python headers are on these machines).
    assert stream_copy.STREAMING, "kvtier.memory._stream_copy was not built: pip install -e ."


@pytest.mark.parametrize("nbytes", [0, 1, 15, 63, 64, 65, 4096 + 7, STREAM_MIN_BYTES + 33])
@pytest.mark.parametrize("dst_offset", [0, 1, 8, 15])
@pytest.mark.parametrize("src_offset", [0, 3])
def test_native_copy_is_byte_exact_at_any_alignment(
    nbytes: int, dst_offset: int, src_offset: int
) -> None:
    from kvtier.memory._stream_copy import stream_copy as native

    rng = np.random.default_rng(nbytes + dst_offset)
    src = rng.integers(0, 256, nbytes + src_offset, dtype=np.uint8)
    dst = np.zeros(nbytes + dst_offset + 16, dtype=np.uint8)
    native(dst[dst_offset : dst_offset + nbytes], src[src_offset:])
    assert np.array_equal(dst[dst_offset : dst_offset + nbytes], src[src_offset:])
    # Nothing around the destination was written.
    assert not dst[:dst_offset].any() and not dst[dst_offset + nbytes :].any()


def test_native_copy_refuses_different_sizes_and_a_read_only_destination() -> None:
    from kvtier.memory._stream_copy import stream_copy as native

    with pytest.raises(ValueError, match="destination has 8 bytes, source 9"):
        native(np.zeros(8, np.uint8), np.zeros(9, np.uint8))
    with pytest.raises(TypeError):
        native(b"12345678", np.zeros(8, np.uint8))


def test_copy_bytes_copies_strided_and_small_arrays_too() -> None:
    src = np.arange(4 * STREAM_MIN_BYTES, dtype=np.uint8).reshape(4, -1)
    dst = np.zeros((4, STREAM_MIN_BYTES // 2), dtype=np.uint8)
    copy_bytes(dst, src[:, ::2])  # strided: the plain copy
    assert np.array_equal(dst, src[:, ::2])
    big = np.zeros_like(src)
    copy_bytes(big, src)  # contiguous and large: the streaming copy
    assert np.array_equal(big, src)


def test_two_threads_copy_at_once_without_corrupting_each_other() -> None:
    # The copy runs without the GIL: both threads are inside it together.
    src = np.random.default_rng(1).integers(0, 256, 64 * STREAM_MIN_BYTES, dtype=np.uint8)
    dst = np.zeros_like(src)
    half = len(src) // 2

    def copy(lo: int, hi: int) -> None:
        for _ in range(4):
            copy_bytes(dst[lo:hi], src[lo:hi])

    threads = [threading.Thread(target=copy, args=(i * half, (i + 1) * half)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert np.array_equal(dst, src)


# -- copy_hash: the copy fused with the PD chunk checksum's block digests ---------------------

BLOCK = 1 << 20


def reference_digests(data: bytes, block: int = BLOCK) -> bytes:
    """The definition (kvtier.pd.checksum): xxh3-64 of each block, 8 little-endian bytes."""
    return b"".join(
        xxhash.xxh3_64_intdigest(data[i : i + block]).to_bytes(8, "little")
        for i in range(0, len(data), block)
    )


def native_copy_hash() -> Callable[..., bytes]:
    assert stream_copy.native_copy_hash is not None, "built without xxhash.h: make system-deps"
    return stream_copy.native_copy_hash


def hash_isas() -> tuple[str, ...]:
    if stream_copy.native_copy_hash is None:
        return ()
    from kvtier.memory._stream_copy import HASH_ISAS

    return HASH_ISAS


@pytest.fixture(params=hash_isas())
def copy_hash(request: pytest.FixtureRequest) -> Callable[..., bytes]:
    """copy_hash run by each kernel this CPU has (AVX-512, AVX2, the default build)."""
    native = native_copy_hash()
    isa = str(request.param)
    return lambda *args: native(*args, isa)


def test_copy_hash_is_built_where_make_installs_kvtier() -> None:
    # The Makefile installs libxxhash-dev before kvtier: without it the fused copy would be
    # silently missing and the checksum hashed in Python, a block at a time.
    native_copy_hash()
    assert hash_isas()[0] == stream_copy.HASH_ISA and hash_isas()[-1] == "default"
    with pytest.raises(ValueError, match="isa 'sparc' is not one this CPU runs"):
        native_copy_hash()(None, [b"1234"], BLOCK, 0, "sparc")


@pytest.mark.parametrize("nbytes", [0, 1, 240, 241, 1025, BLOCK - 1, BLOCK, BLOCK + 1, 5 * BLOCK])
@pytest.mark.parametrize("offset", [0, 5])
def test_copy_hash_copies_and_gives_the_reference_digests(
    nbytes: int, offset: int, copy_hash: Callable[..., bytes]
) -> None:
    rng = np.random.default_rng(nbytes + offset)
    src = rng.integers(0, 256, nbytes + offset, dtype=np.uint8)[offset:]  # unaligned source
    dst = np.zeros(nbytes + 2 * offset, dtype=np.uint8)
    digests = copy_hash([dst[offset : offset + nbytes]], [src], BLOCK, STREAM_MIN_BYTES)
    assert digests == reference_digests(src.tobytes())
    assert np.array_equal(dst[offset : offset + nbytes], src)
    assert not dst[:offset].any() and not dst[offset + nbytes :].any()
    assert copy_hash(None, [src], BLOCK, 0) == digests  # hashing only


@pytest.mark.parametrize("cuts", [(1,), (7, BLOCK - 3), (BLOCK // 3, BLOCK + 5, 2 * BLOCK)])
@pytest.mark.parametrize("gap", [0, 3])
def test_pieces_are_one_stream_cut_into_blocks_wherever_they_end(
    cuts: tuple[int, ...], gap: int, copy_hash: Callable[..., bytes]
) -> None:
    """Blocks run across pieces of any size: a contiguous page served into rows with gaps
    between them (``gap``: a strided view of the caller's KV), or rows that follow each
    other."""
    src = np.random.default_rng(len(cuts)).integers(0, 256, 3 * BLOCK + 11, dtype=np.uint8)
    spans = list(itertools.pairwise([0, *cuts, len(src)]))
    out = np.zeros(len(src) + gap * len(spans), dtype=np.uint8)
    dsts = [out[a + gap * i : b + gap * i] for i, (a, b) in enumerate(spans)]
    digests = copy_hash(dsts, [src[a:b] for a, b in spans], BLOCK, STREAM_MIN_BYTES)
    assert digests == reference_digests(src.tobytes())
    assert all(np.array_equal(d, src[a:b]) for d, (a, b) in zip(dsts, spans, strict=True))
    assert out.sum() == src.sum(dtype=np.int64)  # nothing written into the gaps


@pytest.mark.parametrize("row", [100, 64 << 10, BLOCK // 2 + 7])
def test_a_source_in_rows_apart_is_hashed_in_order(
    row: int, copy_hash: Callable[..., bytes]
) -> None:
    """A sender's chunk cut from a longer KV tensor: its rows are apart in memory, so blocks
    are gathered across them, into a contiguous page."""
    kv = np.random.default_rng(row).integers(0, 256, (8, 2 * row), dtype=np.uint8)
    rows = [kv[i, :row] for i in range(8)]
    page = np.zeros(8 * row, dtype=np.uint8)
    dsts = [page[i * row : (i + 1) * row] for i in range(8)]
    digests = copy_hash(dsts, rows, BLOCK, STREAM_MIN_BYTES)
    assert digests == reference_digests(b"".join(r.tobytes() for r in rows))
    assert np.array_equal(page, np.concatenate(rows))


@pytest.mark.parametrize("block", [1, 64, 241, 4096 + 3])
def test_any_block_size_gives_the_reference_digests(
    block: int, copy_hash: Callable[..., bytes]
) -> None:
    src = np.random.default_rng(block).integers(0, 256, 3 * 4096 + 17, dtype=np.uint8)
    dst = np.zeros_like(src)
    assert copy_hash([dst], [src], block, 0) == reference_digests(src.tobytes(), block)
    assert np.array_equal(dst, src)


@pytest.mark.parametrize("offset", [0, 1000, BLOCK - 1, BLOCK, 2 * BLOCK + 100])
def test_a_flipped_byte_changes_its_blocks_digest_only(
    offset: int, copy_hash: Callable[..., bytes]
) -> None:
    src = np.random.default_rng(offset).integers(0, 256, 3 * BLOCK, dtype=np.uint8)
    dst = np.zeros_like(src)
    before = copy_hash([dst], [src], BLOCK, STREAM_MIN_BYTES)
    src[offset] ^= 0x10
    after = copy_hash([dst], [src], BLOCK, STREAM_MIN_BYTES)
    changed = [i for i in range(3) if before[8 * i : 8 * i + 8] != after[8 * i : 8 * i + 8]]
    assert changed == [offset // BLOCK]
    assert np.array_equal(dst, src)


def test_copy_hash_refuses_mismatched_pieces() -> None:
    copy_hash = native_copy_hash()
    with pytest.raises(ValueError, match="piece 1: destination has 8 bytes, source 9"):
        copy_hash([np.zeros(4, np.uint8), np.zeros(8, np.uint8)], [b"1234", b"x" * 9], BLOCK, 0)
    with pytest.raises(ValueError, match="2 destinations for 1 sources"):
        copy_hash([np.zeros(4, np.uint8)] * 2, [b"1234"], BLOCK, 0)
    with pytest.raises(ValueError, match="block_bytes must be > 0"):
        copy_hash(None, [b"1234"], 0, 0)
    with pytest.raises(BufferError):
        copy_hash([b"1234"], [b"abcd"], BLOCK, 0)  # bytes are read-only


def another_thread_runs_during(call: Callable[[], object], attempts: int = 20) -> bool:
    """Whether the main thread runs Python code while ``call`` runs in a worker thread.

    The switch interval is set past the test's length, so the worker gives up the GIL only
    when it blocks or when ``call`` releases it. The main thread waits for the worker to
    start, then needs the GIL: it gets it while a call is running only if calls release the
    GIL; otherwise the worker keeps the GIL through all its calls and the flag that says
    they are over, so the main thread first runs when ``finished`` is already set. No
    timing is asserted: a slow machine only makes the calls longer.
    """
    started, finished, seen = threading.Event(), threading.Event(), threading.Event()

    def worker() -> None:
        started.set()
        for _ in range(attempts):
            call()
            if seen.is_set():
                break
        finished.set()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(60.0)
    try:
        thread = threading.Thread(target=worker)
        thread.start()
        started.wait()
        ran_during_a_call = not finished.is_set()
        seen.set()
        thread.join()
    finally:
        sys.setswitchinterval(interval)
    return ran_during_a_call


def test_copy_hash_lets_other_threads_run() -> None:
    src = np.random.default_rng(9).integers(0, 256, 64 * BLOCK, dtype=np.uint8)
    dst = np.zeros_like(src)
    copy_hash = native_copy_hash()
    assert another_thread_runs_during(lambda: copy_hash([dst], [src], BLOCK, STREAM_MIN_BYTES))
    # The probe itself: a call known to hold the GIL (bytes.count) lets nothing run.
    data = src.tobytes()
    assert not another_thread_runs_during(lambda: data.count(b"\x00\x01\x02\x03"))
