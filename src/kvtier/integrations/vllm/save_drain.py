"""Saves behind the step: a store's wait for its device-to-host copy, off vLLM's model thread.

A save gathers the request's blocks into a copy buffer (on the model thread, in the model's
stream order, so vLLM's later kernels cannot overwrite the blocks under it), then stores that
buffer: the store queues its copies on kvtier's store stream and waits for their fence before
any host reader sees a page (:mod:`kvtier.memory.device`). Where those copies land late (a
device buffer), the store runs here, on one drain thread, and the model thread goes on::

    model thread (wait_for_save)              drain thread (in submission order)
    buffer = take()         <- a free one;    on CUDA: its stream waits for the gather's event
    gather blocks -> buffer    waits only if  store(buffer): copies queued, landed.wait(),
    submit(rid, job, buffer)   IN_FLIGHT are     then the pages reach their owners
    return                     still copying  buffer back to the pool; rid's count - 1

A request vLLM was told to keep ("delay the free", the scheduler's ``async_saves``) is named
in the next step's ``finishing``; the worker reports it (vLLM's ``finished_sending``) only once
no save of it is left here (:meth:`saving`), so vLLM frees or reuses its blocks only after
every copy out of them landed. Each save has its own buffer, so a buffer is gathered into again
only after its copy landed; at most ``IN_FLIGHT`` buffers exist (a device slower than the
steps makes the model thread wait for one: the bound on memory outside vLLM's budget).

A save that fails is logged and counts as done: the blocks are vLLM's and must go back.
:meth:`close` drains every save queued before it.

Layer-wise saves (:mod:`.layerwise_saves`) gather into a buffer layer by layer and copy each
layer into the buffer's host twin (:meth:`host_twin`) as they go; their jobs (one per request,
the last one giving the buffer back) store from the twin once every layer's copy landed.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch

from kvtier.errors import StateError
from kvtier.integrations.vllm.copy_buffer import CopyBuffer
from kvtier.layout import KVLayout

log = logging.getLogger(__name__)

IN_FLIGHT = 4  # copy buffers of saves still copying, at most

_Job = tuple[
    str, Callable[[], None], CopyBuffer | None, Callable[[], AbstractContextManager[object]]
]


class SaveDrain:
    """See the module docstring. Made closed; :meth:`open` starts the thread."""

    def __init__(self, layout: KVLayout, chunk_size: int, device: torch.device) -> None:
        self._layout = layout
        self._chunk_size = chunk_size
        self._device = device
        self._free: queue.Queue[CopyBuffer] = queue.Queue()
        self._made: list[CopyBuffer] = []  # every buffer, free or copying (IN_FLIGHT at most)
        self._twins: dict[int, CopyBuffer] = {}  # id(buffer) -> its host twin (layer-wise)
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._in_flight: Counter[str] = Counter()  # saves queued, not landed yet, per request
        self._thread: threading.Thread | None = None
        self._closed = False
        self._side_stream: torch.cuda.Stream | None = None

    def open(self) -> SaveDrain:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvtier-saves", daemon=True)
            self._thread.start()
        return self

    def take(self) -> CopyBuffer:
        """A copy buffer no save is copying from (waits for one when ``IN_FLIGHT`` are);
        gather into its ``rows(...)``, then pass it to :meth:`submit`, which gives it back
        once its copy landed."""
        with self._lock:
            if self._free.empty() and len(self._made) < IN_FLIGHT:
                made = CopyBuffer(self._layout, self._chunk_size, self._device)
                self._made.append(made)
                return made
        return self._free.get()

    def submit(self, request_id: str, job: Callable[[], None], buffer: CopyBuffer | None) -> None:
        """Run ``job`` (a store from ``buffer``, which :meth:`take` gave; None: a save that
        gathered straight into pages, :mod:`.one_copy`) behind the step."""
        if self._closed or self._thread is None:
            if buffer is not None:
                self._free.put(buffer)
            raise StateError("kvtier worker: saves are closed")
        with self._lock:
            self._in_flight[request_id] += 1
        self._jobs.put((request_id, job, buffer, self._after_gather()))

    def host_twin(self, buffer: CopyBuffer) -> CopyBuffer:
        """The host buffer that goes with ``buffer`` (pinned on CUDA), free exactly when
        ``buffer`` is and kept as long: a layer-wise save copies into it and stores from it."""
        with self._lock:
            twin = self._twins.get(id(buffer))
            if twin is None:
                pin = self._device.type == "cuda"
                twin = CopyBuffer(self._layout, self._chunk_size, torch.device("cpu"), pin=pin)
                self._twins[id(buffer)] = twin
            return twin

    def give_back(self, buffer: CopyBuffer) -> None:
        """A buffer :meth:`take` gave that no save used."""
        self._free.put(buffer)

    def saving(self, request_id: str) -> bool:
        """Whether a save of ``request_id`` is still queued or copying."""
        with self._lock:
            return self._in_flight[request_id] > 0

    @property
    def tokens(self) -> int:
        """Token rows of every buffer made (memory outside vLLM's budget on a GPU)."""
        with self._lock:
            return sum(buffer.tokens for buffer in self._made)

    def in_flight(self) -> int:
        with self._lock:
            return sum(self._in_flight.values())

    def close(self) -> None:
        """Land and store every save queued so far, then stop the thread. Idempotent."""
        self._closed = True
        thread, self._thread = self._thread, None
        if thread is not None:
            self._jobs.put(None)
            thread.join()

    # -- the drain thread ------------------------------------------------------------------
    def _after_gather(self) -> Callable[[], AbstractContextManager[object]]:
        """On CUDA: what orders the store after the gather the model thread just queued (an
        event on its stream; the drain thread's stream waits for it, and the store's batch
        waits for that stream). Elsewhere the gather already ran."""
        if self._device.type != "cuda":
            return nullcontext
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()  # on the model thread's current stream, after the gather

        def ordered() -> AbstractContextManager[object]:
            if self._side_stream is None:
                self._side_stream = torch.cuda.Stream(device=self._device)  # type: ignore[no-untyped-call]
            self._side_stream.wait_event(event)
            return torch.cuda.stream(self._side_stream)

        return ordered

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            request_id, job, buffer, ordered = item
            try:
                with ordered():
                    job()
            except Exception:
                log.exception("kvtier: a save of request %s failed; its chunks are not stored",
                              request_id)  # fmt: skip
            finally:
                if buffer is not None:
                    self._free.put(buffer)
                with self._lock:
                    self._in_flight[request_id] -= 1
                    if not self._in_flight[request_id]:
                        del self._in_flight[request_id]
