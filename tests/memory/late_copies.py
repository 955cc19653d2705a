"""A copy engine whose copies land late: a GPU's asynchronous copies, on a machine without one.

Tensors marked as "device" memory (:meth:`LateCopies.mark`) behave like CUDA tensors do under
:class:`kvtier.memory.device.DeviceCopies`: a batch's copies run ``delay`` seconds after the
batch closes, on a thread per direction (a store stream and a load stream: no order between
them), and the batch's fence says when they ran. Copies of unmarked tensors run at once.

``lying=True`` makes every fence claim "landed" at once while the copies still run late: the
code that skips waiting, for proving that a scenario sees the race it guards against.
"""

from __future__ import annotations

import queue
import threading
import time

import torch

from kvtier.memory.device import CopyBatch, CopyEngine, DeviceCopies, Direction, Landed

_HOST = DeviceCopies()  # for unmarked tensors: copied at once
_Job = tuple[list[tuple[torch.Tensor, torch.Tensor]], threading.Event]  # copies, then landed


class _EventLanded:
    def __init__(self, event: threading.Event, lying: bool) -> None:
        self._event = event
        self._lying = lying

    def wait(self) -> None:
        if not self._lying and not self._event.wait(30.0):
            raise AssertionError("a late copy never landed")

    def done(self) -> bool:
        return self._lying or self._event.is_set()


class _LateBatch(CopyBatch):
    def __init__(self, engine: LateCopies, direction: Direction) -> None:
        self._engine = engine
        self._direction = direction
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._copies.append((dst, src))

    def close(self) -> Landed:
        return self._engine.submit(self._direction, self._copies)


class LateCopies(CopyEngine):
    def __init__(self, delay: float = 0.1, *, lying: bool = False) -> None:
        self.delay = delay
        self.lying = lying
        self._marked: set[int] = set()
        self._queues: dict[Direction, queue.Queue[_Job]] = {}
        self._threads: list[threading.Thread] = []
        for direction in Direction:
            q: queue.Queue[_Job] = queue.Queue()
            self._queues[direction] = q
            thread = threading.Thread(target=self._run, args=(q,), daemon=True)
            thread.start()
            self._threads.append(thread)
        self.batches = 0  # batches that had copies to make late

    def mark(self, tensor: torch.Tensor) -> torch.Tensor:
        """Treat ``tensor`` (and every view of its memory) as device memory."""
        self._marked.add(tensor.untyped_storage().data_ptr())
        return tensor

    def on_device(self, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() in self._marked

    def begin(self, device_side: torch.Tensor, direction: Direction) -> CopyBatch:
        if not self.on_device(device_side):
            return _HOST.begin(device_side, direction)
        return _LateBatch(self, direction)

    def submit(
        self, direction: Direction, copies: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> Landed:
        event = threading.Event()
        if copies:
            self.batches += 1
            self._queues[direction].put((list(copies), event))
        else:
            event.set()
        return _EventLanded(event, self.lying)

    def drain(self) -> None:
        """Wait until every copy queued so far has run (a device synchronize)."""
        for q in self._queues.values():
            event = threading.Event()
            q.put(([], event))
            assert event.wait(30.0)

    def _run(self, q: queue.Queue[_Job]) -> None:
        while True:
            copies, event = q.get()
            if copies:
                time.sleep(self.delay)
            for dst, src in copies:
                dst.copy_(src)
            event.set()
