"""A copy engine whose copies land late: a GPU's asynchronous copies, on a machine without one.

Tensors marked as "device" memory (:meth:`LateCopies.mark`, or every tensor with
``everything=True``) behave like CUDA tensors do under :class:`kvtier.memory.device.DeviceCopies`:
a batch's copies run late, in order, on a thread per direction (a store stream and a load
stream: no order between them), and the batch's fence says when they ran. Copies of unmarked
tensors run at once.

When "late" is, is the test's to say, never a race against a timer::

    LateCopies()                 held: a batch lands when code waits on its fence (the code
                                 that waits gets its bytes, as from a GPU fast enough for it),
                                 or when the test calls release(); code that never waits sees
                                 nothing land until then
    LateCopies(waits_land=False) held harder: a batch lands only at release(); a wait on its
                                 fence blocks until then (a copy still running while the
                                 caller goes on: proves a call returns before its copy lands)
    LateCopies(delay=0.15)       a timer: each batch lands ``delay`` seconds after it closes

A stream runs its batches in order, so landing one lands every batch queued before it in
that direction.

``lying=True`` makes every fence claim "landed" at once (and its wait lands nothing) while the
copies still land late: the code that skips waiting, for proving that a scenario sees the race
it guards against.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvtier.memory.device import CopyBatch, CopyEngine, DeviceCopies, Direction, Fence

_HOST = DeviceCopies()  # for unmarked tensors: landed when their batch closes
_PATIENCE = 30.0  # seconds a wait for a late copy may take before the test fails


@dataclass
class _Job:
    copies: list[tuple[torch.Tensor, torch.Tensor]]
    ticket: int  # its place in its direction's queue (1, 2, ...)
    landed: threading.Event = field(default_factory=threading.Event)


class _Stream:
    """One direction's queue and the thread that runs it, in order."""

    def __init__(self, delay: float | None) -> None:
        self.delay = delay
        self.jobs: deque[_Job] = deque()
        self.queued = 0  # tickets handed out
        self.released = 0  # jobs with a ticket up to this may land
        self.landed = 0  # jobs that ran
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def put(self, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> _Job:
        with self.cond:
            self.queued += 1
            job = _Job(copies, self.queued)
            self.jobs.append(job)
            self.cond.notify_all()
            return job

    def release(self, upto: int | None = None) -> None:
        with self.cond:
            self.released = max(self.released, self.queued if upto is None else upto)
            self.cond.notify_all()

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.jobs or (self.delay is None and self.jobs[0].ticket > self.released):
                    self.cond.wait()
                job = self.jobs.popleft()
            if self.delay is not None and job.copies:
                time.sleep(self.delay)
            for dst, src in job.copies:
                dst.copy_(src)
            with self.cond:
                self.landed = job.ticket
                self.cond.notify_all()
            job.landed.set()


class _JobLanded:
    def __init__(self, engine: LateCopies, stream: _Stream, job: _Job) -> None:
        self._engine = engine
        self._stream = stream
        self._job = job

    def wait(self) -> None:
        if self._engine.lying:
            return
        self._engine.waits += 1
        if self._engine.waits_land:
            self._stream.release(self._job.ticket)
        if not self._job.landed.wait(_PATIENCE):
            raise AssertionError("a late copy never landed (nobody released it)")

    def done(self) -> bool:
        return self._engine.lying or self._job.landed.is_set()

    def order_current_stream(self) -> None:
        return None  # no stream: the host waits with wait()


class _LateBatch(CopyBatch):
    def __init__(self, engine: LateCopies, direction: Direction) -> None:
        self._engine = engine
        self._direction = direction
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._copies.append((dst, src))

    def close(self, *, order_caller: bool = True) -> Fence:
        return self._engine.submit(self._direction, self._copies)


class LateCopies(CopyEngine):
    """See the module docstring. ``delay``: seconds (a timer) instead of held copies."""

    def __init__(
        self,
        delay: float | None = None,
        *,
        lying: bool = False,
        waits_land: bool = True,
        everything: bool = False,
    ) -> None:
        self.delay = delay
        self.lying = lying
        self.waits_land = waits_land
        self.everything = everything  # every tensor counts as device memory
        self._marked: set[int] = set()
        self._streams = {direction: _Stream(delay) for direction in Direction}
        self.batches = 0  # batches that had copies to make late
        self.waits = 0  # waits on a late batch's fence (not counting a lying one's)

    def mark(self, tensor: torch.Tensor) -> torch.Tensor:
        """Treat ``tensor`` (and every view of its memory) as device memory."""
        self._marked.add(tensor.untyped_storage().data_ptr())
        return tensor

    def on_device(self, tensor: torch.Tensor) -> bool:
        return self.everything or tensor.untyped_storage().data_ptr() in self._marked

    def begin(self, device_side: torch.Tensor, direction: Direction) -> CopyBatch:
        if not self.on_device(device_side):
            return _HOST.begin(device_side, direction)
        return _LateBatch(self, direction)

    def submit(
        self, direction: Direction, copies: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> Fence:
        stream = self._streams[direction]
        if copies:
            self.batches += 1
        job = stream.put(list(copies))
        if not copies:
            stream.release(job.ticket)  # nothing to make late
        return _JobLanded(self, stream, job)

    def pending(self) -> int:
        """Batches queued that have not landed yet."""
        return sum(len(s.jobs) for s in self._streams.values())

    def land_next(self, direction: Direction) -> None:
        """Land the next batch held in ``direction`` (one fence: one layer's copy) and wait
        until it ran; later batches stay held."""
        stream = self._streams[direction]
        with stream.cond:
            ticket = stream.released + 1
            assert ticket <= stream.queued, f"no {direction} batch is held"
            stream.release(ticket)
            assert stream.cond.wait_for(lambda: stream.landed >= ticket, _PATIENCE)

    def release(self) -> None:
        """Land every copy queued so far and wait until they ran (a device synchronize)."""
        for stream in self._streams.values():
            stream.release()
        self.drain()

    def drain(self) -> None:
        """Wait until every copy queued so far has run; held copies are released first."""
        for stream in self._streams.values():
            job = stream.put([])
            stream.release(job.ticket)
            assert job.landed.wait(_PATIENCE), "a late copy never landed"


def returns_within(seconds: float, call: Callable[[], object]) -> bool:
    """Run ``call`` on a thread: whether it returned within ``seconds`` (a call that waits
    for a held copy waits until the test releases it)."""
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(seconds)
    return not thread.is_alive()


def eventually(condition: Callable[[], bool], seconds: float = 10.0) -> bool:
    """Whether ``condition`` holds within ``seconds`` (polled: work behind a drain thread)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
