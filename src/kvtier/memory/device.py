"""The one owner of every copy between device (GPU) memory and host pages, and "landed".

A copy between device and host memory is asynchronous on CUDA: ``copy_(..., non_blocking=True)``
returns before the bytes move. So a copy is only half of a store or a load; the other half is
knowing it landed. The storage protocol, with :class:`DeviceCopies` as the only place such a
copy is made::

    store (device -> page)                         load (page -> device)
    batch = copies.begin(kv, STORE)                batch = copies.begin(out, LOAD)
    batch.copy(page_view, kv_part)  (many)         batch.copy(out_part, page_view)  (many)
    landed = batch.close()                         landed = batch.close()
    landed.wait()   <- before ANY host reader:     the device's current stream waits on it
                       a writer thread, a checksum,  (compute that reads ``out`` is ordered
                       a codec, the server, a PD      after the copy); the pages' lease keeps
                       sender, the CPU index          ``landed`` and waits on it before it gives
                                                      the pages back (no page is reused or
                                                      released while a copy from it runs)

On CUDA each device has two streams of kvtier's own (stores, loads). A batch first waits on the
caller's current stream (the kernels that produced ``kv``, or that last used ``out``), makes its
copies on kvtier's stream, records one event, and tells the caching allocator that its stream
uses the device tensor (``record_stream``), so the tensor's memory is not reused under the copy.
A host tensor (no device involved) is copied at once: its batch has landed when it closes.

The copy engine is a seam (:class:`CopyEngine`): tests inject one whose copies land late, on
machines without a GPU, to prove every host reader waits for "landed".
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from enum import StrEnum
from typing import Protocol

import torch


class Landed(Protocol):
    """A fence after a batch of copies: ``wait()`` returns once every copy of the batch has
    moved its bytes; ``done()`` says so without waiting."""

    def wait(self) -> None: ...

    def done(self) -> bool: ...


class _AlreadyLanded:
    """The fence of copies that ran to completion when they were made (host to host)."""

    def wait(self) -> None:
        return None

    def done(self) -> bool:
        return True


LANDED: Landed = _AlreadyLanded()


class CopyBatch(ABC):
    """Copies that share one fence. Make them with :meth:`copy`, then :meth:`close` once."""

    @abstractmethod
    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue ``dst.copy_(src)``; it may land after this returns."""

    @abstractmethod
    def close(self) -> Landed:
        """The fence after every copy of this batch (no more copies after it)."""


class Direction(StrEnum):
    STORE = "store"  # device tensor -> host pages
    LOAD = "load"  # host pages -> device tensor


class CopyEngine(ABC):
    """Makes the copies between one device tensor and host pages (see the module docstring)."""

    @abstractmethod
    def begin(self, device_side: torch.Tensor, direction: Direction) -> CopyBatch:
        """A batch of copies to (LOAD) or from (STORE) ``device_side``, the tensor that is
        not a page."""

    def on_device(self, tensor: torch.Tensor) -> bool:
        """Whether copies to or from ``tensor`` may land after they return."""
        return tensor.device.type != "cpu"


class _HostBatch(CopyBatch):
    """Copies made at once: nothing is left in flight when ``copy`` returns."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def close(self) -> Landed:
        return LANDED


class _CudaEventLanded:
    def __init__(self, event: torch.cuda.Event) -> None:
        self._event = event

    def wait(self) -> None:
        self._event.synchronize()

    def done(self) -> bool:
        return bool(self._event.query())  # type: ignore[no-untyped-call]


class _CudaBatch(CopyBatch):
    def __init__(
        self, stream: torch.cuda.Stream, device_side: torch.Tensor, direction: Direction
    ) -> None:
        self._stream = stream
        self._device_side = device_side
        self._direction = direction
        self._caller = torch.cuda.current_stream(device_side.device)
        # The copies must see every kernel the caller queued before (the one that wrote
        # ``kv``; the last one that read ``out``).
        stream.wait_stream(self._caller)
        self._copied = False

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
        self._copied = True

    def close(self) -> Landed:
        if not self._copied:
            return LANDED
        # The caching allocator must not hand the device tensor's memory to anyone else
        # while kvtier's stream still reads or writes it.
        self._device_side.record_stream(self._stream)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self._stream)
        if self._direction is Direction.LOAD:
            # Whatever the caller queues next on its stream (the layer that reads the load)
            # runs after the copies. A store needs no such wait: its host side waits for
            # "landed" before any reader, and the caller's later kernels may overlap it.
            self._caller.wait_event(event)
        return _CudaEventLanded(event)


class DeviceCopies(CopyEngine):
    """The default engine: CUDA tensors on kvtier's own streams (one for stores and one for
    loads per device, made on first use), anything else copied at once."""

    def __init__(self) -> None:
        self._streams: dict[tuple[int, Direction], torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    def begin(self, device_side: torch.Tensor, direction: Direction) -> CopyBatch:
        if device_side.device.type != "cuda":
            return _HostBatch()
        stream = self._stream_for(device_side.device, direction)
        return _CudaBatch(stream, device_side, direction)

    def _stream_for(self, device: torch.device, direction: Direction) -> torch.cuda.Stream:
        index = device.index if device.index is not None else torch.cuda.current_device()
        with self._lock:
            stream = self._streams.get((index, direction))
            if stream is None:
                stream = torch.cuda.Stream(device=index)  # type: ignore[no-untyped-call]
                self._streams[index, direction] = stream
            return stream


class LandedSet:
    """Fences still to wait for before pages are given back (a lease's loads in flight)."""

    def __init__(self) -> None:
        self._pending: list[Landed] = []
        self._lock = threading.Lock()

    def add(self, landed: Landed) -> None:
        if landed.done():
            return
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()]
            self._pending.append(landed)

    def wait(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for landed in pending:
            landed.wait()
