"""Asynchronous tier writes on a few threads, with a ceiling on bytes in flight.

The disk and Redis tiers both write through one of these; it owns their one admission rule.

Admission (:meth:`WriteQueue.submit`, never blocks)::

    nothing queued or being written          -> accepted (even one write above limit_bytes)
    in flight + this write <= limit_bytes    -> accepted
    else                                     -> refused: the caller completes it DROPPED

Why these are the writes dropped: a tier slower than the stores (a stalled disk, a slow
network) would otherwise hold ever more CPU pages hostage in its queue, and a store must never
wait (the step that stores is on the inference path). Dropping the newest write costs one
chunk that a later request recomputes and stores again; waiting would cost every request. The
first write always fits, so a write larger than the ceiling is slow, not impossible (a tier
that can never hold it, like a disk smaller than one record, refuses it before the queue).

Protocol:

* Each accepted write runs ``write_fn(write)`` on one of ``threads`` threads, and its
  :class:`PutResult` goes to ``write.on_done`` exactly once, also when ``write_fn`` raises
  (FAILED) or the callback itself raises (logged). The callback runs *before* the write stops
  counting as in flight, so once :meth:`flush` returns every callback has run (the storage
  manager's staging pages are back).
* :meth:`holds` says whether a key is queued or being written (a tier answers a second put of
  it EXISTS instead of writing it twice).
* :meth:`flush` waits until nothing is queued or running; :meth:`close` drains the queue
  (bounded by its timeout), then stops the threads. ``write_fn`` should bound each write's
  time (socket timeouts); where it cannot (a stuck filesystem), ``close(timeout)`` returns
  False and leaves the daemon threads behind instead of hanging.
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
        self._keys: dict[ChunkKey, int] = {}  # key -> writes of it queued or running
        self._pending = 0

    def open(self) -> None:
        for i in range(self._nthreads):
            thread = threading.Thread(target=self._run, name=f"{self._name}-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)

    @property
    def inflight_bytes(self) -> int:
        """Bytes queued or being written now (a gauge)."""
        return self._inflight_bytes

    def holds(self, key: ChunkKey) -> bool:
        """Whether a write of ``key`` is queued or running."""
        with self._lock:
            return key in self._keys

    def submit(self, write: Write) -> str:
        """Queue ``write`` and return ``""``, or return why it is refused (the admission rule
        in the module docstring); the caller then completes the refused write itself."""
        with self._lock:
            if self._pending and self._inflight_bytes + write.nbytes > self.limit_bytes:
                return (
                    f"{self._inflight_bytes} bytes already in flight (bound {self.limit_bytes}): "
                    "the tier is slower than the stores"
                )
            self._inflight_bytes += write.nbytes
            self._pending += 1
            self._keys[write.key] = self._keys.get(write.key, 0) + 1
        self._queue.put(write)
        return ""

    def flush(self, timeout: float | None = None) -> bool:
        with self._lock:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Drain (waiting up to ``timeout``), then stop the threads; joins them only when the
        queue drained. Returns whether it drained. Idempotent."""
        drained = self.flush(timeout)
        for _ in self._threads:
            self._queue.put(None)
        if drained:
            for thread in self._threads:
                thread.join()
        self._threads.clear()
        return drained

    def _run(self) -> None:
        while (write := self._queue.get()) is not None:
            try:
                result = self._write_fn(write)
            except Exception as exc:  # a bug must not kill the thread and hang flush/close
                log.exception("%s: write of %s failed unexpectedly", self._name, write.key.hex())
                result = PutResult(write.key, PutOutcome.FAILED, repr(exc))
            complete(write.on_done, result)
            with self._lock:
                self._inflight_bytes -= write.nbytes
                self._pending -= 1
                left = self._keys[write.key] - 1
                if left:
                    self._keys[write.key] = left
                else:
                    del self._keys[write.key]
                self._idle.notify_all()


def complete(on_done: OnDone, result: PutResult) -> None:
    """Run a completion callback; its exception is logged, never propagated."""
    try:
        on_done(result)
    except Exception:
        log.exception("put completion callback failed for %s", result.key.hex())
