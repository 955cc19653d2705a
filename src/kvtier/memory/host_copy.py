"""Copies between host tensors on threads of kvtier's own: :class:`HostCopies`, and the
process's one copier that host copy batches use (:func:`shared`).

Why not ``Tensor.copy_``. A chunk's copy into or out of its page is strided on the caller's
side (a chunk's rows of ``[planes, layers, tokens, hidden]``), and torch copies it on its
OpenMP pool, one parallel region per copy:

- in one process (``kvtier bench cpu``) the strided copy reached 0.86-0.92 of a flat memcpy of
  the same bytes: cProfile put 97.5 % of a retrieve and 86 % of a store inside ``copy_``;
- across processes (vLLM replicas sharing one ``kvtier server``) libgomp's workers spin on
  their core after every region (``GOMP_SPINCOUNT``), and a region waits for its slowest,
  descheduled thread: ``kvtier bench server`` measured 1 client 16.9-17.6 GB/s, 2 clients 11.0
  and 4 clients 8.3 in aggregate.

Here a copy is cut into pieces, each contiguous on both sides: one per plane and layer of a
chunk (a run of ``tokens * hidden`` values), or runs of :data:`PIECE_BYTES` of a copy that is
contiguous as a whole. The caller and ``threads - 1`` helpers take them one at a time from a
shared list, each copied by :func:`~kvtier.memory.stream_copy.copy_bytes` (streaming stores,
no GIL). An idle helper sleeps on a queue, never spins; a worker that is descheduled delays
only the piece it holds, the others take the rest::

    pieces:  [p0 p1 p2 p3 p4 ... p63]   (a 256-token chunk of 32 layers, K and V)
    caller:   p0    p2 p3    p5 ...
    helper:      p1       p4    ...     whoever is free takes the next one

The caller never waits for a helper that has not started: once the list is empty it cancels
the helpers' tasks still queued (a pool busy with another caller's copy, or one left behind
by a fork) and waits only for those that run. Less than :data:`PARALLEL_MIN_BYTES` in all is
copied by the caller alone (waking a helper costs more than it saves). A pair torch must
convert (other dtypes, another device, rows that are not contiguous in memory) is one
``Tensor.copy_`` by the worker that takes it.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from kvtier.memory.stream_copy import copy_bytes

Pair = tuple[torch.Tensor, torch.Tensor]  # (dst, src), the same shape
# A piece as the workers see it: two byte arrays of one shape (copy_bytes), or a pair of
# tensors that torch copies.
_Piece = tuple[np.ndarray, np.ndarray] | Pair

PIECE_BYTES = 1 << 20  # a contiguous copy is cut into pieces of about this size
PARALLEL_MIN_BYTES = 1 << 20  # below this in all, the caller copies alone


class HostCopies:
    """Copies between host tensors on up to ``threads`` workers, the caller and helpers (see
    the module docstring); ``threads=None``: as many as torch's intra-op setting
    (``torch.get_num_threads()``) at each run. The helpers start at :meth:`open` and end at
    :meth:`close` (idempotent); ``run`` before ``open`` or after ``close`` copies on the
    caller alone. ``run`` may be called from several threads at once."""

    def __init__(self, threads: int | None) -> None:
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None

    def open(self) -> None:
        helpers = (self.threads or os.cpu_count() or 1) - 1
        if self._pool is None and helpers > 0:
            self._pool = ThreadPoolExecutor(helpers, thread_name_prefix="kvtier-copy")

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def run(self, pairs: list[Pair]) -> None:
        """Copy each ``src`` into its ``dst``; every copy has landed when this returns (also
        when one raised: the error is raised after the helpers are done with the tensors)."""
        pieces: list[_Piece] = []
        total = 0
        for dst, src in pairs:
            if dst.shape != src.shape:
                raise ValueError(f"copy of {tuple(src.shape)} into {tuple(dst.shape)}")
            pieces += _pieces(dst, src)
            total += dst.numel() * dst.element_size()
        shared = iter(pieces)  # a list iterator: next() is atomic under the GIL
        futures: list[Future[None]] = []
        pool = self._pool
        if pool is not None and total >= PARALLEL_MIN_BYTES:
            threads = self.threads or torch.get_num_threads()
            helpers = min(threads - 1, len(pieces) - 1)
            futures = [pool.submit(_drain, shared) for _ in range(helpers)]
        try:
            _drain(shared)
        finally:
            for future in futures:
                if not future.cancel():  # it started: it holds a piece, or is about to stop
                    future.result()


_shared: HostCopies | None = None
_shared_pid = 0
_shared_lock = threading.Lock()


def shared() -> HostCopies:
    """The process's copier, which host copy batches use (:mod:`kvtier.memory.device`): one
    pool per process, as torch's OpenMP pool is, so that engines, clients and senders in one
    process do not each keep idle helpers. Its helpers start at the first copy that wants
    them (the pool makes a thread only when no idle one is there) and end with the process;
    a forked child makes its own."""
    global _shared, _shared_pid
    pid = os.getpid()
    copier = _shared
    if copier is not None and _shared_pid == pid:
        return copier
    with _shared_lock:
        if _shared is None or _shared_pid != pid:
            made = HostCopies(threads=None)
            made.open()
            _shared, _shared_pid = made, pid
        return _shared


def copy_now(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, landed when this returns: host tensors of one shape on the shared
    copier's threads (:func:`shared`), anything else (a broadcast, a device) by torch."""
    if dst.shape == src.shape and dst.device.type == src.device.type == "cpu":
        shared().run([(dst, src)])
    else:
        dst.copy_(src)


def _pieces(dst: torch.Tensor, src: torch.Tensor) -> list[_Piece]:
    """``(dst, src)`` as contiguous byte pieces: one per index of every dimension but the
    last two (``[planes, layers, n, hidden]``: one piece per plane and layer), or runs of
    :data:`PIECE_BYTES` where both sides are contiguous as a whole. A pair that has no byte
    view on both sides (see :func:`_as_bytes`) stays whole, for torch."""
    d = _as_bytes(dst) if dst.dtype == src.dtype else None
    s = _as_bytes(src) if d is not None else None
    if d is None or s is None:
        return [(dst, src)]
    if d.flags.c_contiguous and s.flags.c_contiguous:
        d, s = d.reshape(-1), s.reshape(-1)  # views: a contiguous array reshapes without a copy
    lead = [range(n) for n in d.shape[:-2]]
    out: list[_Piece] = []
    for i in itertools.product(*lead):
        dp, sp = d[i], s[i]  # numpy indexing: views, far cheaper than a torch index
        parts = -(-dp.nbytes // PIECE_BYTES)
        if parts > 2 and dp.shape[0] > 1:
            out += zip(np.array_split(dp, parts), np.array_split(sp, parts), strict=True)
        else:
            out.append((dp, sp))
    return out


def _as_bytes(tensor: torch.Tensor) -> np.ndarray | None:
    """A CPU tensor's bytes as a numpy uint8 view, its last dimension counted in bytes (any
    strides elsewhere); None where there is none: another device, a view torch has not
    materialised (conjugate, negative), or a last dimension that is not contiguous."""
    if tensor.device.type != "cpu" or tensor.dim() == 0 or tensor.is_conj() or tensor.is_neg():
        return None
    try:
        plain = tensor.detach()
        return (plain if plain.dtype == torch.uint8 else plain.view(torch.uint8)).numpy()
    except (RuntimeError, TypeError):
        return None


def _drain(pieces: Iterator[_Piece]) -> None:
    for dst, src in pieces:
        if isinstance(dst, np.ndarray):
            assert isinstance(src, np.ndarray)
            copy_bytes(dst, src)  # np.copyto where a side is strided (no GIL either)
        else:
            assert isinstance(src, torch.Tensor)
            dst.copy_(src)
