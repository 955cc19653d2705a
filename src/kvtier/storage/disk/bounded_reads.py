"""Reads with a deadline: the disk tier's reads run on a reader pool and the caller waits
at most ``timeout_s`` for them.

A read still running at the deadline (a hung network filesystem: the thread is stuck in
the kernel and cannot be interrupted) is abandoned: :class:`ReadAbandoned` names it, with
its future, so the caller keeps the buffer it writes into out of use until it really
returns. While any abandoned read is still running the tier is *stalled*: every read
misses at once instead of queueing more threads behind the stuck one.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from concurrent.futures import TimeoutError as FuturesTimeout
from typing import Any

import torch

from kvtier.cpu_affinity import unpin_current_thread
from kvtier.keys import ChunkKey
from kvtier.storage.base import ReadAbandoned

log = logging.getLogger(__name__)

ReadOne = Callable[[ChunkKey, torch.Tensor], "int | None"]


class BoundedReads:
    """See the module docstring. Thread-safe."""

    def __init__(self, threads: int, timeout_s: float, where: str) -> None:
        self.timeout_s = timeout_s
        self.where = where
        self.timeouts = 0  # reads abandoned so far
        self.stalled = 0  # abandoned reads still running
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(
            threads, thread_name_prefix="kvtier-disk-read", initializer=unpin_current_thread
        )

    def read(
        self, read_one: ReadOne, items: Sequence[tuple[ChunkKey, torch.Tensor]]
    ) -> list[int | None] | None:
        """``read_one`` of each item on the pool; None (all misses) while stalled. Raises
        ReadAbandoned naming the reads still running at the deadline."""
        with self._lock:
            if self.stalled:
                return None
        futures = [self._pool.submit(read_one, key, out) for key, out in items]
        if len(futures) == 1:  # the common single read: no waiter set to build
            try:
                return [futures[0].result(self.timeout_s)]
            except FuturesTimeout:
                pass
        _, running = wait(futures, timeout=self.timeout_s)
        results = [None if f in running else f.result() for f in futures]
        if running:
            self._abandon(running)
            busy: dict[int, Future[Any]] = {i: f for i, f in enumerate(futures) if f in running}
            raise ReadAbandoned(
                f"{len(running)} disk reads still running after {self.timeout_s:g}s",
                busy,
                results,
            )
        return results

    def close(self) -> None:
        """Stop the pool; wait for its threads unless a read is stuck."""
        with self._lock:
            stalled = self.stalled
        self._pool.shutdown(wait=not stalled, cancel_futures=True)

    def _abandon(self, running: set[Future[int | None]]) -> None:
        with self._lock:
            first = self.stalled == 0
            self.stalled += len(running)
            self.timeouts += len(running)
        if first:
            log.warning(
                "disk tier %s: reads did not finish within %.1fs (a stuck filesystem?); reads "
                "miss at once until they return",
                self.where,
                self.timeout_s,
            )
        for future in running:
            future.add_done_callback(self._returned)

    def _returned(self, _: Future[int | None]) -> None:
        with self._lock:
            self.stalled -= 1
            back = self.stalled == 0
        if back:
            log.info("disk tier %s: stalled reads returned; reading again", self.where)
