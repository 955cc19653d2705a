"""The PD chunk checksum, and copying a chunk while computing it in the same pass.

Definition (the sender computes it, the decoder verifies every byte it serves against it)::

    block j      = bytes [j * BLOCK_BYTES, (j + 1) * BLOCK_BYTES) of the chunk, in canonical
                   order (the last block may be shorter)
    d_j          = xxh3-64(block j), as 8 little-endian bytes
    checksum     = xxh3-64(d_0 || d_1 || ...)              (xxh3-64 of b"" for no bytes)

Why blocks rather than one digest of the whole chunk: a block is hashed right after it is
copied, while it is still in the core's cache, so copy and check cost one pass over memory,
not two; and two threads can each copy and hash half of a chunk. The copies are numpy
copies, which run without the GIL, so one thread copies while the other hashes (xxhash holds
the GIL); torch's own copy would fan each 1 MiB block out to its intra-op threads, which
measured several times slower on two busy cores.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Executor

import numpy as np
import torch
import xxhash

BLOCK_BYTES = 1 << 20
# Copies go in pieces of two blocks: larger memcpys run faster (4 MiB ones about 40% faster
# than 1 MiB ones), smaller pieces are still in L2 when hashed; fused copy-and-hash measured
# best between 1 and 4 MiB, by under the run-to-run noise of a shared two-core host.
COPY_BYTES = 2 * BLOCK_BYTES


def combine(digests: list[int]) -> int:
    """The chunk checksum from its block digests, in order."""
    return int(xxhash.xxh3_64_intdigest(np.asarray(digests, dtype="<u8").tobytes()))


class BlockHasher:
    """The chunk checksum fed in pieces of any size, in order (a socket's reads, say)."""

    def __init__(self) -> None:
        self._digests: list[int] = []
        self._partial = xxhash.xxh3_64()
        self._fill = 0  # bytes of the current block seen so far

    def update(self, piece: memoryview | np.ndarray) -> None:
        view = memoryview(piece).cast("B")  # type: ignore[arg-type]  # ndarray is a Buffer
        while view.nbytes:
            take = min(BLOCK_BYTES - self._fill, view.nbytes)
            if self._fill == 0 and take == BLOCK_BYTES:
                self._digests.append(xxhash.xxh3_64_intdigest(view[:take]))
            else:
                self._partial.update(view[:take])
                self._fill += take
                if self._fill == BLOCK_BYTES:
                    self._close_block()
            view = view[take:]

    def _close_block(self) -> None:
        self._digests.append(self._partial.intdigest())
        self._partial.reset()
        self._fill = 0

    def block_digests(self) -> list[int]:
        if self._fill:
            self._close_block()
        return self._digests

    def intdigest(self) -> int:
        return combine(self.block_digests())


def checksum(data: torch.Tensor) -> int:
    """The checksum of a contiguous CPU tensor's bytes (no copy)."""
    hasher = BlockHasher()
    hasher.update(_flat_bytes(data))
    return hasher.intdigest()


def copy_with_checksum(
    dst: torch.Tensor, src: torch.Tensor, helper: Executor | None, *, hash_source: bool = False
) -> int:
    """Copy ``src`` (any shape and strides; its bytes in canonical order) into ``dst`` (flat
    contiguous uint8, exactly that many bytes) and return the checksum, each piece hashed
    right after it is copied, while it is in cache: by default of what landed in ``dst`` (a
    reader verifying what it serves), with ``hash_source`` of ``src`` (a sender stating what
    it meant to send; the source is the side the copy only read, and it measured faster to
    hash). With ``helper`` (an executor with a free thread) the second half of the chunk is
    copied and hashed there at the same time.
    """
    pieces = _pieces(dst, src)
    split = _half(pieces)
    side = 2 if hash_source else 1  # which array of a Piece to hash
    if helper is None or split in (0, len(pieces)):
        return combine(_copy_and_hash(pieces, side))
    second = helper.submit(_copy_and_hash, pieces[split:], side)
    try:
        first = _copy_and_hash(pieces[:split], side)
    finally:
        rest = second.result()  # even on an error: the helper must be done with dst
    return combine(first + rest)


Piece = tuple[int, np.ndarray, np.ndarray]  # (offset in dst, dst bytes, src bytes)


def _pieces(dst: torch.Tensor, src: torch.Tensor) -> list[Piece]:
    nbytes = src.numel() * src.element_size()
    if dst.dtype != torch.uint8 or not dst.is_contiguous() or dst.numel() != nbytes:
        raise ValueError(f"dst must be {nbytes} contiguous uint8 bytes, got {tuple(dst.shape)}")
    out = dst.numpy()
    if src.is_contiguous():
        flat = _flat_bytes(src)
        return [
            (o, out[o : o + COPY_BYTES], flat[o : o + COPY_BYTES])
            for o in range(0, nbytes, COPY_BYTES)
        ]
    # A strided view (a chunk cut from a longer KV tensor): one piece per row of its last two
    # dimensions, whose bytes are contiguous in dst; the hasher cuts them into blocks.
    raw = src if src.element_size() == 1 else src.view(torch.uint8)  # needs stride(-1) == 1
    rows = raw.numpy().reshape(-1, *raw.shape[-2:])
    target = out.reshape(rows.shape)
    step = rows[0].nbytes
    return [(i * step, target[i], rows[i]) for i in range(len(rows))]


def _half(pieces: list[Piece]) -> int:
    """The first piece at or past the middle that starts on a block boundary (each thread's
    share must start a block for its digests to combine); len(pieces) when none does."""
    if not pieces:
        return 0
    end = pieces[-1][0] + pieces[-1][1].nbytes
    for i, (offset, _, _) in enumerate(pieces):
        if offset * 2 >= end and offset % BLOCK_BYTES == 0:
            return i
    return len(pieces)


def _copy_and_hash(pieces: list[Piece], side: int) -> list[int]:
    hasher = BlockHasher()
    for _, out, data in pieces:
        np.copyto(out, data)  # without the GIL: the other thread hashes meanwhile
        hasher.update(data if side == 2 else out)
    return hasher.block_digests()


def _flat_bytes(data: torch.Tensor) -> np.ndarray:
    if not data.is_contiguous():
        raise ValueError("checksum needs a contiguous tensor")
    flat = data.reshape(-1)
    return (flat if flat.element_size() == 1 else flat.view(torch.uint8)).numpy()


class CopyThreads:
    """Picks one thread or two for each :func:`copy_with_checksum`, by measured speed.

    Two threads win on an idle two-core host (a 2-thread copy ran 14 GB/s against 8.4 for
    one); on a host whose cores are busy with other work the hand-off loses and one thread
    wins (0.91 against 0.70 of the best memcpy, measured under load). So each mode keeps its
    last few speeds, the mode whose best recent speed is higher is used (other work only
    ever slows a copy down, so the best sample is the least disturbed), and the other mode is
    tried again every ``EXPLORE_EVERY`` chunks so that a change in load is noticed.
    """

    EXPLORE_EVERY = 8
    SAMPLES = 4

    def __init__(self, helper: Executor) -> None:
        self.helper = helper
        self._rates: dict[bool, deque[float]] = {
            two: deque(maxlen=self.SAMPLES) for two in (True, False)
        }
        self._count = 0
        self._lock = threading.Lock()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, hash_source: bool = False) -> int:
        with self._lock:
            self._count += 1
            two = self._choose()
        start = time.perf_counter()
        digest = copy_with_checksum(dst, src, self.helper if two else None, hash_source=hash_source)
        rate = dst.numel() / max(time.perf_counter() - start, 1e-9)
        with self._lock:
            self._rates[two].append(rate)
        return digest

    def measured(self) -> dict[bool, float]:
        """Best recent bytes per second of each mode measured so far (two threads? -> rate)."""
        with self._lock:
            return {two: max(r) for two, r in self._rates.items() if r}

    def _choose(self) -> bool:
        two, one = self._rates[True], self._rates[False]
        if not two or not one:
            return not two  # each mode once first: two threads, then one
        faster = max(two) >= max(one)
        return not faster if self._count % self.EXPLORE_EVERY == 0 else faster
