from __future__ import annotations

import threading

import torch

from kvtier.storage.base import PutOutcome, PutResult
from kvtier.storage.write_queue import Write, WriteQueue
from tests.storage.tier_contract import Outcomes


def _write(i: int, done: Outcomes, nbytes: int = 10) -> Write:
    return Write(bytes([i]) * 16, torch.zeros(4, dtype=torch.uint8), 1, nbytes, done)


def test_over_the_limit_is_refused_and_the_first_always_fits() -> None:
    gate = threading.Event()

    def slow(write: Write) -> PutResult:
        gate.wait(10)
        return PutResult(write.key, PutOutcome.STORED)

    queue = WriteQueue(1, limit_bytes=15, write_fn=slow, name="t")
    queue.open()
    done = Outcomes()
    assert queue.submit(_write(0, done, nbytes=100)) == ""  # bigger than the limit, but first
    assert "in flight" in queue.submit(_write(1, done))
    assert not queue.flush(0.05)
    gate.set()
    assert queue.flush(5.0)
    assert queue.submit(_write(2, done)) == ""
    queue.close()
    assert [r.outcome for r in done.wait(2)] == [PutOutcome.STORED] * 2


def test_a_raising_write_or_callback_still_completes_every_write_once() -> None:
    def broken(write: Write) -> PutResult:
        if write.key[0] % 2:
            raise RuntimeError("bug")
        return PutResult(write.key, PutOutcome.STORED)

    queue = WriteQueue(2, limit_bytes=1000, write_fn=broken, name="t")
    queue.open()
    done = Outcomes()
    calls: list[PutResult] = []

    def bad_callback(result: PutResult) -> None:
        calls.append(result)
        raise ValueError("callback bug")

    for i in range(6):
        assert queue.submit(_write(i, done)) == ""
    queue.submit(Write(b"\x09" * 16, torch.zeros(1, dtype=torch.uint8), 1, 1, bad_callback))
    queue.close()  # drains: nothing hangs although writes and a callback raised
    outcomes = sorted((r.key[0], r.outcome) for r in done.wait(6))
    assert [o for _, o in outcomes] == [PutOutcome.STORED, PutOutcome.FAILED] * 3
    assert len(calls) == 1 and calls[0].outcome is PutOutcome.FAILED


def test_flush_returns_after_every_callback_and_holds_names_queued_keys() -> None:
    gate = threading.Event()

    def slow(write: Write) -> PutResult:
        gate.wait(10)
        return PutResult(write.key, PutOutcome.STORED)

    queue = WriteQueue(1, limit_bytes=1000, write_fn=slow, name="t")
    queue.open()
    seen: list[PutResult] = []
    first, second = _write(1, Outcomes()), _write(2, Outcomes())
    first.on_done = second.on_done = seen.append
    assert queue.submit(first) == "" and queue.submit(second) == ""
    assert queue.holds(first.key) and queue.holds(second.key) and not queue.holds(b"\x00" * 16)
    assert queue.inflight_bytes == 20
    gate.set()
    assert queue.flush(5.0)
    assert len(seen) == 2  # flush means the callbacks ran, not only the writes
    assert not queue.holds(first.key) and queue.inflight_bytes == 0
    assert queue.close(1.0)
