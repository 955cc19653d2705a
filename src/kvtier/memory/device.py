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
A host tensor (no device involved) is copied when its batch closes, on kvtier's host copy
threads (:mod:`kvtier.memory.host_copy`, the why is there): its batch has landed when it closes.

The copy engine is a seam (:class:`CopyEngine`): tests inject one whose copies land late, on
machines without a GPU, to prove every host reader waits for "landed".

A LOAD orders the caller's stream after its event when it closes (the default), or later::

    landed = batch.close()                     the caller's stream waits on the event now:
                                               all it queues next runs after the copies
    landed = batch.close(order_caller=False)   nothing waits yet (the caller may queue more
    ...                                        copies, and compute that does not read them)
    landed.order_current_stream()              the current stream waits on the event now

A layer-wise load needs the second form: layer i+1's copy is queued before layer i computes,
and layer i's compute must wait for layer i's event only. Where nothing is queued on a stream
(a host, a test's engine) ``order_current_stream`` is a no-op: the host waits with ``wait``.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from enum import StrEnum
from typing import Protocol

import torch

from kvtier.memory import host_copy


class Landed(Protocol):
    """A fence after a batch of copies: ``wait()`` returns once every copy of the batch has
    moved its bytes; ``done()`` says so without waiting."""

    def wait(self) -> None: ...

    def done(self) -> bool: ...


class Fence(Landed, Protocol):
    """What a batch's :meth:`~CopyBatch.close` returns: a :class:`Landed` that can also order
    the device's current stream after it, the host not waiting (``order_current_stream``:
    what is queued on that stream next runs after the copies; a no-op where nothing is
    queued on a stream)."""

    def order_current_stream(self) -> None: ...


class _AlreadyLanded:
    """The fence of copies that ran to completion when they were made (host to host)."""

    def wait(self) -> None:
        return None

    def done(self) -> bool:
        return True

    def order_current_stream(self) -> None:
        return None


LANDED: Fence = _AlreadyLanded()


class CopyBatch(ABC):
    """Copies that share one fence. Make them with :meth:`copy`, then :meth:`close` once."""

    @abstractmethod
    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue ``dst.copy_(src)``; it may land after this returns."""

    @abstractmethod
    def close(self, *, order_caller: bool = True) -> Fence:
        """The fence after every copy of this batch (no more copies after it).

        ``order_caller`` (a LOAD into a device): the caller's current stream waits on the
        fence now. False leaves that to :meth:`Fence.order_current_stream`, called when
        the compute that reads the copies is about to be queued (the module docstring)."""


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
    """Host-to-host copies: gathered by ``copy``, made by ``close`` on the process's host copy
    threads (:func:`kvtier.memory.host_copy.shared`: contiguous pieces shared out among the
    caller and helpers, not one strided ``Tensor.copy_`` each on torch's OpenMP pool), all of
    a batch in one run: the caller waits for the helpers once per batch, not once per chunk.
    Every copy has landed when ``close`` returns (its fence: LANDED)."""

    def __init__(self) -> None:
        self._pairs: list[host_copy.Pair] = []

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if dst.shape == src.shape and dst.device.type == src.device.type == "cpu":
            self._pairs.append((dst, src))
        else:  # a broadcast, or a device no batch of this engine owns: torch's, at once
            dst.copy_(src)

    def close(self, *, order_caller: bool = True) -> Fence:
        pairs, self._pairs = self._pairs, []
        if pairs:
            host_copy.shared().run(pairs)
        return LANDED


class _CudaEventLanded:
    def __init__(self, event: torch.cuda.Event, device: torch.device) -> None:
        self._event = event
        self._device = device

    def wait(self) -> None:
        self._event.synchronize()

    def done(self) -> bool:
        return bool(self._event.query())  # type: ignore[no-untyped-call]

    def order_current_stream(self) -> None:
        torch.cuda.current_stream(self._device).wait_event(self._event)


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

    def close(self, *, order_caller: bool = True) -> Fence:
        if not self._copied:
            return LANDED
        # The caching allocator must not hand the device tensor's memory to anyone else
        # while kvtier's stream still reads or writes it.
        self._device_side.record_stream(self._stream)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self._stream)
        if self._direction is Direction.LOAD and order_caller:
            # Whatever the caller queues next on its stream (the layer that reads the load)
            # runs after the copies. A store needs no such wait: its host side waits for
            # "landed" before any reader, and the caller's later kernels may overlap it.
            self._caller.wait_event(event)
        return _CudaEventLanded(event, self._device_side.device)


class DeviceCopies(CopyEngine):
    """The default engine: CUDA tensors on kvtier's own streams (one for stores and one for
    loads per device, made on first use), host tensors on the host copy threads when their
    batch closes."""

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
