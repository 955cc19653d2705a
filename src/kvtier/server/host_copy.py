"""A client's copies between its host KV and the server's shared pages, on threads of its own.

Why not ``Tensor.copy_``: torch copies on its OpenMP pool, and libgomp's workers spin on
their core for a while after every parallel region (``GOMP_SPINCOUNT``, milliseconds). One
client process alone gets both cores of a 2-core host that way; two or four client processes
(vLLM replicas sharing one ``kvtier server``) each leave a spinning worker on the cores the
others are copying on, and a parallel region waits for its slowest thread, so a copy stalls
whenever one of its threads was descheduled. ``kvtier bench server`` measured 1 client 16.9 to
17.6 GB/s, 2 clients 11.0 and 4 clients 8.3 in aggregate: more clients, less bandwidth.

Here a copy is cut into pieces (one per plane and layer of a chunk: a contiguous run of
``tokens * hidden`` values on both sides) which ``threads`` workers (the caller and
``threads - 1`` helpers) take one at a time from a shared list, each copied by
:func:`~kvtier.memory.stream_copy.copy_bytes` without the GIL. An idle helper sleeps on a
queue, never spins; a worker that is descheduled delays only the piece it holds, the others
take the rest::

    pieces:  [p0 p1 p2 p3 p4 ... p63]   (a 256-token chunk of 32 layers, K and V)
    caller:   p0    p2 p3    p5 ...
    helper:      p1       p4    ...     whoever is free takes the next one

A piece that is not contiguous on either side (a caller's strided tensor), or whose dtypes
differ, is copied with ``Tensor.copy_`` by the worker that takes it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from kvtier.memory.stream_copy import copy_bytes

Pair = tuple[torch.Tensor, torch.Tensor]  # (dst, src), the same shape and dtype


class HostCopies:
    """Copies between host tensors on ``threads`` workers (see the module docstring). The
    helpers start at :meth:`open` and end at :meth:`close` (idempotent); ``run`` before
    ``open`` or after ``close`` copies on the caller alone."""

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        self._pool: ThreadPoolExecutor | None = None

    def open(self) -> None:
        if self._pool is None and self.threads > 1:
            self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="kvtier-copy")

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def run(self, pairs: list[Pair]) -> None:
        """Copy each ``src`` into its ``dst``; every copy has landed when this returns (also
        when one raised: the error is raised after the helpers are done with the tensors)."""
        pieces = [piece for dst, src in pairs for piece in _pieces(dst, src)]
        shared = iter(pieces)  # a list iterator: next() is atomic under the GIL
        pool = self._pool
        helpers = min(self.threads - 1, len(pieces) - 1) if pool is not None else 0
        futures = [pool.submit(_drain, shared) for _ in range(helpers)] if pool else []
        try:
            _drain(shared)
        finally:
            for future in futures:
                future.result()


def _pieces(dst: torch.Tensor, src: torch.Tensor) -> list[Pair]:
    """``(dst, src)`` cut along every dimension but the last two (``[planes, layers, n,
    hidden]``: one piece per plane and layer)."""
    if dst.shape != src.shape:
        raise ValueError(f"copy of {tuple(src.shape)} into {tuple(dst.shape)}")
    lead = [range(n) for n in dst.shape[:-2]]  # indexing, never reshaping: always views
    return [(dst[i], src[i]) for i in itertools.product(*lead)]


def _drain(pieces: Iterator[Pair]) -> None:
    for dst, src in pieces:
        if dst.dtype == src.dtype and dst.is_contiguous() and src.is_contiguous():
            copy_bytes(_bytes(dst), _bytes(src))
        else:
            dst.copy_(src)


def _bytes(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous tensor's bytes as a flat uint8 numpy array (a view)."""
    flat = tensor.reshape(-1)
    return (flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)).numpy()
