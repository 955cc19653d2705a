"""A save never blocks vLLM's step, and vLLM frees no block before the copies out of it landed
(kvtier.integrations.vllm.save_drain, the scheduler's ``async_saves``).

No GPU here: the worker's copies go through a copy engine whose copies land only when the
test releases them (tests/memory/late_copies.py), as a GPU's copies land after the call that
queued them. The scheduler and the worker are the real ones, joined by the real lookup
channel; the engine is real."""

from __future__ import annotations

import time
import uuid
from types import SimpleNamespace

import pytest
import torch

from kvtier.config import Config
from kvtier.integrations.vllm.metadata import KVTierMetadata, SaveSpec
from kvtier.integrations.vllm.rpc import LookupClient
from kvtier.integrations.vllm.scheduler import SchedulerSide
from kvtier.integrations.vllm.worker import WorkerSide
from tests.integrations.vllm.worker_helpers import (
    BLOCK,
    CHUNK,
    CHUNK_BYTES,
    DIM,
    HEADS,
    IDLE_STEP,
    LAYERS,
    fill,
    kv_caches,
    step_of_new,
)
from tests.memory.late_copies import LateCopies, eventually, returns_within


def late_worker(copies: LateCopies) -> WorkerSide:
    """A registered worker whose KV counts as device memory: its saves' copies land late."""
    side = WorkerSide(
        Config.load(overrides={"chunk_size": CHUNK, "max_local_cpu_size": f"{8 * CHUNK_BYTES}B"},
                    env={}),
        model_name="tiny",
        engine_id=f"test-{uuid.uuid4().hex}",
        tp_rank=0,
        tp_world_size=1,
        block_size=BLOCK,
        num_kv_heads=HEADS,
        head_dim=DIM,
        copies=copies,
    )  # fmt: skip
    side.register(kv_caches())
    return side


def reported(worker: WorkerSide, seconds: float = 10.0) -> set[str]:
    """What the worker reports finished sending, once it reports anything."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done = worker.finished_saves()
        if done:
            return done
        time.sleep(0.01)
    return set()


def test_a_save_returns_before_its_copy_lands_and_no_block_goes_before_it_lands() -> None:
    """A prompt chunk is saved; its copy is held. ``save`` returns at once, with the copy
    still in flight and no host reader seeing the chunk; the request then ends: vLLM is told
    to keep its blocks, and the worker does not report it finished while the copy is held.
    Released, the chunk is in kvtier, exact, and the request is reported, once."""
    copies = LateCopies(waits_land=False, everything=True)
    worker = late_worker(copies)
    scheduler = SchedulerSide(
        [LookupClient(worker.engine_id)],
        block_size=BLOCK,
        chunk_size=CHUNK,
        loads=True,
        saves=True,
        async_saves=True,
    )
    try:
        assert worker.engine is not None and worker.paged is not None
        prompt = list(range(9000, 9040))  # 40 tokens: one whole chunk
        request = SimpleNamespace(request_id="t1", prompt_token_ids=prompt, kv_transfer_params=None)
        assert scheduler.num_new_matched_tokens(request, 0) == (0, False)
        blocks = [20, 21, 22]
        fill(worker, blocks, seed=33)
        want = torch.zeros(worker.engine.layout.kv_shape(CHUNK))
        worker.paged.gather(blocks, 0, CHUNK, want)
        scheduler.after_alloc(request, blocks, 0)
        meta = scheduler.build_meta(step_of_new("t1", prompt, blocks, len(prompt)))
        assert [(s.start, s.end) for s in meta.saves] == [(0, CHUNK)]

        # The step's save returns while its copy is held.
        assert returns_within(5.0, lambda: worker.save(meta)), "save waited for its copy"
        assert eventually(lambda: copies.pending() == 1), "the save's copy was never queued"
        assert copies.batches == 1  # queued by the drain thread, not landed
        probe = LookupClient(worker.engine_id)
        assert probe.lookup("probe", prompt, None).tokens == 0  # no host reader has it yet
        probe.end("probe")

        # The request ends: vLLM keeps its blocks until the worker names it.
        ended = SimpleNamespace(
            request_id="t1", output_token_ids=[1], num_computed_tokens=len(prompt)
        )
        assert scheduler.save_output(ended, (blocks,)) is True  # "delay the free"
        scheduler.finished("t1")
        step = scheduler.build_meta(IDLE_STEP)
        assert step.finishing == ["t1"] and step.saves == []
        assert returns_within(5.0, lambda: worker.save(step))
        for _ in range(3):  # steps go on; the copy is still held
            assert worker.finished_saves() == set()
            time.sleep(0.02)
        assert copies.pending() == 1

        copies.release()
        assert reported(worker) == {"t1"} and worker.finished_saves() == set()  # once
        copies.waits_land = True  # the read-back below waits for its own copies
        assert probe.lookup("t2", prompt + [1], None).tokens == CHUNK
        got = torch.zeros_like(want)
        assert worker.engine.retrieve_into(prompt[:CHUNK], "t2", got) == CHUNK
        worker.engine.end_request("t2")
        assert torch.equal(got, want)
        assert scheduler.build_meta(IDLE_STEP).finishing == []  # named once
        assert worker.engine.leaks() == [] and worker.engine.check_invariants() == []
        probe.close()
    finally:
        copies.release()
        scheduler.close()
        worker.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_a_save_behind_a_busy_stream_stores_the_blocks_exact() -> None:
    """The CUDA path of the same: the blocks' bytes arrive only after a long queue of kernels
    on the model's stream, the save returns without waiting, and its store (on the drain
    thread, ordered after the gather by an event) still reads them exact."""
    worker = WorkerSide(
        Config.load(overrides={"chunk_size": CHUNK, "max_local_cpu_size": f"{8 * CHUNK_BYTES}B"},
                    env={}),
        model_name="tiny",
        engine_id=f"test-{uuid.uuid4().hex}",
        tp_rank=0,
        tp_world_size=1,
        block_size=BLOCK,
        num_kv_heads=HEADS,
        head_dim=DIM,
    )  # fmt: skip
    worker.register({name: t.cuda() for name, t in kv_caches().items()})
    try:
        assert worker.engine is not None and worker.paged is not None
        prompt, blocks = list(range(9200, 9240)), [20, 21, 22]
        want = torch.randn(LAYERS, len(blocks), HEADS, BLOCK, 2 * DIM)
        busy = torch.randn(4096, 4096, device="cuda")
        for _ in range(20):
            busy = busy @ busy
            busy /= busy.norm()
        for layer, values in zip(worker.paged.layers, want, strict=True):
            layer[blocks] = values.cuda()  # queued behind the busy kernels
        expected = torch.zeros(worker.engine.layout.kv_shape(CHUNK), device="cuda")
        worker.paged.gather(blocks, 0, CHUNK, expected)
        meta = KVTierMetadata(saves=[SaveSpec("g", prompt[:CHUNK], blocks, 0, CHUNK)])
        worker.save(meta)
        worker.save(KVTierMetadata(finishing=["g"]))
        assert reported(worker, 60.0) == {"g"}
        assert worker.engine.lookup(prompt, "g2").tokens == CHUNK
        got = torch.zeros(worker.engine.layout.kv_shape(CHUNK))
        assert worker.engine.retrieve_into(prompt[:CHUNK], "g2", got) == CHUNK
        worker.engine.end_request("g2")
        assert torch.equal(got, expected.cpu())
    finally:
        worker.close()
