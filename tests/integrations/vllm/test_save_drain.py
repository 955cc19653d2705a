"""The drain that runs a worker's stores behind the step (kvtier.integrations.vllm.save_drain):
its copy buffers are bounded, a buffer is handed out again only once its save is done, a
save that fails still counts as done (vLLM's blocks must go back), and close drains."""

from __future__ import annotations

import threading

import torch

from kvtier.integrations.vllm.copy_buffer import CopyBuffer
from kvtier.integrations.vllm.save_drain import IN_FLIGHT, SaveDrain
from tests.conftest import SMALL_CHUNK, SMALL_LAYOUT


def test_buffers_are_bounded_and_reused_only_once_their_save_is_done() -> None:
    drain = SaveDrain(SMALL_LAYOUT, SMALL_CHUNK, torch.device("cpu")).open()
    gate = threading.Event()
    try:
        buffers = [drain.take() for _ in range(IN_FLIGHT)]
        assert len({id(b) for b in buffers}) == IN_FLIGHT
        for buffer in buffers:
            buffer.rows(SMALL_CHUNK)
            drain.submit("r", gate.wait, buffer)
        assert drain.saving("r") and drain.in_flight() == IN_FLIGHT
        assert drain.tokens == IN_FLIGHT * SMALL_CHUNK
        taken: list[CopyBuffer] = []
        waiter = threading.Thread(target=lambda: taken.append(drain.take()), daemon=True)
        waiter.start()
        waiter.join(0.3)
        assert waiter.is_alive() and not taken  # every buffer is still copying
        gate.set()
        waiter.join(10)
        assert taken and any(taken[0] is b for b in buffers)

        def fails() -> None:
            raise RuntimeError("a tier broke mid-store")

        drain.submit("x", fails, taken[0])
    finally:
        gate.set()
        drain.close()
    assert not drain.saving("x") and not drain.saving("r") and drain.in_flight() == 0
