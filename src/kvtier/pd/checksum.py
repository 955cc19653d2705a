"""The PD chunk checksum, and copying a chunk while computing it in the same pass.

Definition (the sender computes it, the decoder verifies every byte it serves against it)::

    block j      = bytes [j * BLOCK_BYTES, (j + 1) * BLOCK_BYTES) of the chunk, in canonical
                   order (the last block may be shorter)
    d_j          = xxh3-64(block j), as 8 little-endian bytes
    checksum     = xxh3-64(d_0 || d_1 || ...)              (xxh3-64 of b"" for no bytes)

Why blocks rather than one digest of the whole chunk: a copy copies a block and hashes its
source right after, while the block is still in the core's cache, so copy and check cost one
pass over memory, not two; and two threads can each copy and hash half of a chunk.

Where kvtier's C extension was built with xxhash.h (:data:`FUSED`), copy and hash are one
call per thread without the GIL (``copy_hash``, :mod:`kvtier.memory.stream_copy`): each KiB
of a block is copied with streaming stores (the destination is never read: no
read-for-ownership), then fed to xxh3's stripe loop (vectorised for the CPU) from L1, so the
copy of the next KiB overlaps the hashing of this one, and two threads copy and hash at once.
Without it, each 1 MiB block is copied by :func:`~kvtier.memory.stream_copy.copy_bytes`
(streaming, without the GIL) and hashed by python ``xxhash`` (4.x releases the GIL for pieces
over 64 KiB), each block a trip through Python and two GIL hand-offs between the threads.
Both give the same digests. What is hashed is the source the copy read: a sender states what
it meant to send; a reader serving a page checks the page's bytes in the pass that copies
them out.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Executor

import numpy as np
import torch
import xxhash

from kvtier.memory.stream_copy import STREAM_MIN_BYTES, copy_bytes, native_copy_hash

FUSED = native_copy_hash is not None  # copy and hash in C, without the GIL

BLOCK_BYTES = 1 << 20
# Pieces of a contiguous chunk, as the threads' shares are cut. In Python (not FUSED) copies
# go a block at a time, a block just copied still in the core's L2 when it is hashed; smaller
# pieces measured slower on two threads (256 KiB: 17 GB/s against 23 for 1 MiB), each trip
# through Python and the GIL costing more than it saves. FUSED copies go 16 KiB at a time
# inside the C kernel, whatever the pieces.
COPY_BYTES = BLOCK_BYTES


def combine(digests: bytes) -> int:
    """The chunk checksum from its block digests, in order, 8 little-endian bytes each."""
    return int(xxhash.xxh3_64_intdigest(digests))


class BlockHasher:
    """The chunk checksum fed in pieces of any size, in order (a socket's reads, say)."""

    def __init__(self) -> None:
        self._digests = bytearray()  # d_0 || d_1 || ...
        self._partial = xxhash.xxh3_64()
        self._fill = 0  # bytes of the current block seen so far

    def update(self, piece: memoryview | np.ndarray) -> None:
        view = memoryview(piece).cast("B")  # type: ignore[arg-type]  # ndarray is a Buffer
        while view.nbytes:
            take = min(BLOCK_BYTES - self._fill, view.nbytes)
            if self._fill == 0 and take == BLOCK_BYTES:
                self._digests += xxhash.xxh3_64_intdigest(view[:take]).to_bytes(8, "little")
            else:
                self._partial.update(view[:take])
                self._fill += take
                if self._fill == BLOCK_BYTES:
                    self._close_block()
            view = view[take:]

    def _close_block(self) -> None:
        self._digests += self._partial.intdigest().to_bytes(8, "little")
        self._partial.reset()
        self._fill = 0

    def block_digests(self) -> bytes:
        if self._fill:
            self._close_block()
        return bytes(self._digests)

    def intdigest(self) -> int:
        return combine(self.block_digests())


def checksum(data: torch.Tensor) -> int:
    """The checksum of a contiguous CPU tensor's bytes (no copy; without the GIL when
    :data:`FUSED`)."""
    flat = _flat_bytes(data)
    if native_copy_hash is not None:
        return combine(native_copy_hash(None, [flat], BLOCK_BYTES, 0))
    hasher = BlockHasher()
    hasher.update(flat)
    return hasher.intdigest()


def copy_with_checksum(dst: torch.Tensor, src: torch.Tensor, helper: Executor | None) -> int:
    """Copy ``src`` into ``dst`` and return the checksum of the bytes copied, each piece
    hashed right after its copy, from the cache. With ``helper`` (an executor with a free
    thread) the second half of the chunk is copied and hashed there at the same time.

    Either side may be strided, as long as each row of its last two dimensions is contiguous
    (a chunk cut from a longer ``[2, layers, tokens, hidden]`` KV tensor)::

        dst                          src                       used by
        flat contiguous uint8        any shape, same bytes     a sender filling a page
        src's shape and dtype        contiguous (a page)       a decoder serving a page
                                                               straight into the caller's KV

    What is hashed is ``src``'s bytes in canonical order.
    """
    pieces = _pieces(dst, src)
    split = _half(pieces)
    if helper is None or split in (0, len(pieces)):
        return combine(_copy_and_hash(pieces))
    second = helper.submit(_copy_and_hash, pieces[split:])
    try:
        first = _copy_and_hash(pieces[:split])
    finally:
        rest = second.result()  # even on an error: the helper must be done with dst
    return combine(first + rest)


Piece = tuple[int, np.ndarray, np.ndarray]  # (offset in src's canonical bytes, dst, src)


def _pieces(dst: torch.Tensor, src: torch.Tensor) -> list[Piece]:
    nbytes = src.numel() * src.element_size()
    if dst.dtype == torch.uint8 and dst.dim() == 1 and dst.is_contiguous():
        if dst.numel() != nbytes:
            raise ValueError(f"dst must be {nbytes} contiguous uint8 bytes, got {dst.numel()}")
        out = dst.numpy()
        if src.is_contiguous():
            flat = _flat_bytes(src)
            return [
                (o, out[o : o + COPY_BYTES], flat[o : o + COPY_BYTES])
                for o in range(0, nbytes, COPY_BYTES)
            ]
        # A strided view (a chunk cut from a longer KV tensor): one piece per row of its last
        # two dimensions, whose bytes are contiguous in dst; the hasher cuts them into blocks.
        rows = _rows("src", src, copy_ok=True)
        target = out.reshape(rows.shape)
        step = rows[0].nbytes if len(rows) else 0
        return [(i * step, target[i], rows[i]) for i in range(len(rows))]
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise ValueError(
            f"dst must be {nbytes} contiguous uint8 bytes or a {src.dtype} tensor of shape "
            f"{tuple(src.shape)}, got {dst.dtype} {tuple(dst.shape)}"
        )
    if not src.is_contiguous():
        raise ValueError("a strided dst needs a contiguous src")
    # A page served into a view of the caller's tensor: row by row, the page read in order.
    targets = _rows("dst", dst)
    rows = _rows("src", src)
    step = rows[0].nbytes if len(rows) else 0
    return [(i * step, targets[i], rows[i]) for i in range(len(rows))]


def _rows(name: str, data: torch.Tensor, copy_ok: bool = False) -> np.ndarray:
    """``data``'s bytes as rows of its last two dimensions (``[rows, n, bytes]``). Without
    ``copy_ok`` (a destination: writes into a copy would be lost) raises ValueError when that
    needs a copy."""
    if data.dim() < 2:
        raise ValueError(f"{name} must have at least two dimensions, got {tuple(data.shape)}")
    try:
        raw = data if data.element_size() == 1 else data.view(torch.uint8)  # stride(-1) == 1
        rows = raw.view(-1, *raw.shape[-2:])
    except RuntimeError as exc:
        if not copy_ok:
            raise ValueError(f"{name} cannot be cut into rows without a copy: {exc}") from None
        raw = data.contiguous()
        raw = raw if raw.element_size() == 1 else raw.view(torch.uint8)
        rows = raw.view(-1, *raw.shape[-2:])
    array = rows.numpy()
    if len(array) and not array[0].flags.c_contiguous:
        if copy_ok:
            return np.ascontiguousarray(array)
        raise ValueError(f"{name}'s rows of its last two dimensions must be contiguous")
    return array


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


def _copy_and_hash(pieces: list[Piece]) -> bytes:
    if native_copy_hash is not None:
        dsts = [out for _, out, _ in pieces]
        srcs = [data for _, _, data in pieces]
        return native_copy_hash(dsts, srcs, BLOCK_BYTES, STREAM_MIN_BYTES)
    hasher = BlockHasher()
    for _, out, data in pieces:
        # The copy reads the piece from memory, leaving it in the cache for the hash (hash
        # first measured 10% slower).
        copy_bytes(out, data)
        hasher.update(data)
    return hasher.block_digests()


def _flat_bytes(data: torch.Tensor) -> np.ndarray:
    if not data.is_contiguous():
        raise ValueError("checksum needs a contiguous tensor")
    flat = data.reshape(-1)
    return (flat if flat.element_size() == 1 else flat.view(torch.uint8)).numpy()


class CopyThreads:
    """Picks one thread or two for each :func:`copy_with_checksum`, by measured speed.

    Two threads win on an idle two-core host (17-20 GB/s against 13-14 for one, streaming
    copies with their hashing); on a host whose cores are busy with other work the hand-off
    can lose and one thread win. So each mode keeps its last few speeds, the mode whose best
    recent speed is higher is used (other work only ever slows a copy down, so the best sample
    is the least disturbed), and the other mode is tried again once its last sample is
    ``EXPLORE_SECONDS`` old, so that a change in load is noticed. A time bound rather than a
    chunk count: trying the slower mode every 8th chunk cost about 10% of the throughput of a
    busy transfer, four times a second costs one 32 MiB chunk in about a hundred. The first
    copies of a mode are often slow (a thread starting, torch's OpenMP workers still spinning
    after the caller's last parallel op), so a wrong first choice must be undone soon.
    """

    EXPLORE_SECONDS = 0.25
    SAMPLES = 4
    WARMUP = 3  # samples of each mode before the faster one is chosen

    def __init__(self, helper: Executor) -> None:
        self.helper = helper
        self._rates: dict[bool, deque[float]] = {
            two: deque(maxlen=self.SAMPLES) for two in (True, False)
        }
        self._tried: dict[bool, float] = {}  # monotonic time each mode was last chosen
        self._lock = threading.Lock()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> int:
        with self._lock:
            two = self._choose()
            self._tried[two] = time.monotonic()
        start = time.perf_counter()
        digest = copy_with_checksum(dst, src, self.helper if two else None)
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
        if len(two) < self.WARMUP or len(one) < self.WARMUP:
            # Each mode a few times first, in turn: a first copy is often slow (cold pages,
            # a thread starting), and one bad sample must not decide for good.
            return len(two) <= len(one)
        faster = max(two) >= max(one)
        stale = time.monotonic() - self._tried[not faster] >= self.EXPLORE_SECONDS
        return not faster if stale else faster
