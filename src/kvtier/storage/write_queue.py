"""Asynchronous tier writes on a few threads, with a ceiling on bytes in flight.

Protocol:

* :meth:`WriteQueue.submit` never blocks: it queues the write and returns ``""``, or returns
  why it refused (over ``limit_bytes`` queued or being written); the caller then completes
  that write itself (DROPPED). The first write is always accepted when nothing is in flight,
  so a single chunk larger than the limit still gets written.
* Each queued write runs ``write_fn(write)`` on one of ``threads`` threads, and its
  :class:`PutResult` goes to ``write.on_done`` exactly once, also when ``write_fn`` raises
  (FAILED) or the callback itself raises (logged).
* :meth:`flush` waits until nothing is queued or running; :meth:`close` drains the queue,
  then stops and joins the threads. ``write_fn`` bounds each write's time (socket timeouts),
  which bounds both.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvtier.keys import ChunkKey
from kvtier.storage.base import OnDone, PutOutcome, PutResult

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Write:
    key: ChunkKey
    payload: torch.Tensor  # flat uint8, valid until on_done runs
    num_tokens: int
    nbytes: int  # what counts against the in-flight ceiling
    on_done: OnDone


class WriteQueue:
    """See the module docstring."""

    def __init__(
        self,
        threads: int,
        limit_bytes: int,
        write_fn: Callable[[Write], PutResult],
        name: str,
    ) -> None:
        self.limit_bytes = limit_bytes
        self._write_fn = write_fn
        self._name = name
        self._nthreads = threads
        self._threads: list[threading.Thread] = []
        self._queue: queue.SimpleQueue[Write | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._inflight_bytes = 0
        self._pending = 0

    def open(self) -> None:
        for i in range(self._nthreads):
            thread = threading.Thread(target=self._run, name=f"{self._name}-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def submit(self, write: Write) -> str:
        with self._lock:
            if self._inflight_bytes and self._inflight_bytes + write.nbytes > self.limit_bytes:
                return f"over {self.limit_bytes} bytes in flight"
            self._inflight_bytes += write.nbytes
            self._pending += 1
        self._queue.put(write)
        return ""

    def flush(self, timeout: float | None = None) -> bool:
        with self._lock:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def close(self) -> None:
        self.flush(None)
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join()
        self._threads.clear()

    def _run(self) -> None:
        while (write := self._queue.get()) is not None:
            try:
                result = self._write_fn(write)
            except Exception as exc:  # a bug must not kill the thread and hang flush/close
                log.exception("%s: write of %s failed unexpectedly", self._name, write.key.hex())
                result = PutResult(write.key, PutOutcome.FAILED, repr(exc))
            with self._lock:
                self._inflight_bytes -= write.nbytes
                self._pending -= 1
                self._idle.notify_all()
            complete(write.on_done, result)


def complete(on_done: OnDone, result: PutResult) -> None:
    """Run a completion callback; its exception is logged, never propagated."""
    try:
        on_done(result)
    except Exception:
        log.exception("put completion callback failed for %s", result.key.hex())
