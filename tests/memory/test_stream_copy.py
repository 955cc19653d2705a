"""Streaming-store copies: byte-exact at any alignment and size, refused when sizes differ,
and built on every machine the project's own set-up installs (a C compiler is there)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

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
