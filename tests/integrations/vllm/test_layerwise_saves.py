"""Layer-wise saves on the worker (``use_layerwise``), with a real Engine and real paged
tensors, without vLLM's processes (kvtier.integrations.vllm.layerwise_saves): each layer's
part of the step's saves leaves in its own hook without waiting for its copy, nothing is
stored before every layer's copy landed, the bytes stored are the whole-chunk save's, and a
save whose layers were not all copied is skipped, never half-stored.

"Device" copies go through a copy engine whose copies land only when the test releases them
(tests/memory/late_copies.py): "late" is an event the test controls, not a timer.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
import torch

from kvtier.integrations.vllm.metadata import KVTierMetadata, SaveSpec
from kvtier.integrations.vllm.worker import WorkerSide
from kvtier.memory.device import CopyEngine, Direction
from tests.integrations.vllm.worker_helpers import (
    LAYERS,
    fill,
    make_worker,
)
from tests.memory.late_copies import LateCopies, eventually, returns_within

A = list(range(300, 370))  # 70 tokens: 2 whole chunks
B = list(range(700, 740))  # 40 tokens: 1 whole chunk
A_BLOCKS = [3, 4, 5, 6, 7]
B_BLOCKS = [10, 11, 12]


def make(copies: CopyEngine | None = None, *, layerwise: bool = True) -> WorkerSide:
    """A registered worker (``copies``: its copy engine; a late one makes its KV "device")."""
    return make_worker(copies=copies, use_layerwise=layerwise)


@pytest.fixture
def host_worker() -> Iterator[WorkerSide]:
    side = make()
    yield side
    side.close()


def step() -> KVTierMetadata:
    """One step saving A's 2 chunks and B's 1 (packed in one buffer, A first)."""
    return KVTierMetadata(
        saves=[SaveSpec("a", A[:64], A_BLOCKS, 0, 64), SaveSpec("b", B[:32], B_BLOCKS, 0, 32)],
        finishing=["a", "b"],
    )


def names(worker: WorkerSide) -> tuple[str, ...]:
    assert worker.paged is not None
    return worker.paged.layer_names


def all_reported(worker: WorkerSide, want: set[str]) -> bool:
    """Whether the worker reports every one of ``want`` finished sending (each is reported
    once, maybe in different steps), within 10 s."""
    seen: set[str] = set()
    return eventually(lambda: bool(seen.update(worker.finished_saves())) or seen == want)


def served(worker: WorkerSide, tokens: list[int]) -> torch.Tensor:
    """What the worker's CPU tier serves for ``tokens`` (its payload, every layer)."""
    engine = worker.engine
    assert engine is not None
    rid = f"probe-{uuid.uuid4().hex}"
    hit = engine.lookup([*tokens, 1], rid).tokens
    out = torch.zeros(engine.layout.kv_shape(hit))
    if hit:
        assert engine.retrieve_into(tokens[:hit], rid, out) == hit
    engine.end_request(rid)  # waits for the load's copies
    return out


def whole_chunk_payloads() -> dict[str, torch.Tensor]:
    """What whole-chunk saves (use_layerwise off, wait_for_save only) store from the same
    blocks: the payloads layer-wise saves must equal."""
    worker = make(layerwise=False)
    try:
        fill(worker, A_BLOCKS + B_BLOCKS, seed=71)
        worker.save(step())
        return {"a": served(worker, A[:64]), "b": served(worker, B[:32])}
    finally:
        worker.close()


def test_each_layer_leaves_in_its_hook_and_nothing_is_stored_before_every_layer_landed() -> None:
    copies = LateCopies(waits_land=False, everything=True)
    worker = make(copies)
    try:
        assert worker.engine is not None and worker._saves is not None
        fill(worker, A_BLOCKS + B_BLOCKS, seed=71)
        meta = step()
        for n, name in enumerate(names(worker)):
            # vLLM's save_kv_layer after layer n: its copy is queued, and the call returns.
            assert returns_within(5.0, lambda name=name: worker.save_layer(name, meta)), (
                f"layer {n}'s save waited for its copy"
            )
            assert copies.pending() == n + 1  # one batch, one fence per layer, all held
        assert returns_within(5.0, lambda: worker.save(meta)), "wait_for_save waited"
        assert copies.batches == LAYERS  # the layers' copies only: nothing else moved yet

        for landed in range(LAYERS - 1):  # every layer but the last lands
            copies.land_next(Direction.STORE)
            time.sleep(0.2)  # a store that did not wait for the last layer would be here
            assert served(worker, A[:64]).shape[2] == 0, f"stored after {landed + 1} layers"
            assert served(worker, B[:32]).shape[2] == 0
            assert worker._saves.saving("a") and worker._saves.saving("b")
            assert worker.finished_saves() == set()  # vLLM keeps the blocks

        copies.waits_land = True  # the stores and read-backs below wait for their own copies
        copies.land_next(Direction.STORE)
        assert all_reported(worker, {"a", "b"})
        want = whole_chunk_payloads()
        assert torch.equal(served(worker, A[:64]), want["a"])
        assert torch.equal(served(worker, B[:32]), want["b"])
        assert want["a"].shape[2] == 64 and want["b"].shape[2] == 32
        assert worker.stats()["layerwise_saves"] == 2
        assert worker.stats()["layerwise_save_skips"] == 0
        assert worker.engine.leaks() == [] and worker.engine.check_invariants() == []
    finally:
        copies.release()
        worker.close()


@pytest.mark.parametrize("late", [False, True], ids=["host-kv", "device-kv"])
@pytest.mark.parametrize("hooks", [[0], [1], []], ids=["ended-early", "layer-0-skipped", "none"])
def test_a_save_whose_layers_were_not_all_copied_is_skipped_whole(
    late: bool, hooks: list[int]
) -> None:
    """A forward that ended after layer 0, or whose layer 0 hook never came: no chunk of the
    plan is stored, ever, and the requests are still reported (vLLM frees their blocks once
    the copies out of them landed). No hook at all (a step with no forward): saved whole."""
    copies = LateCopies(everything=True) if late else None
    worker = make(copies)
    try:
        fill(worker, A_BLOCKS + B_BLOCKS, seed=72)
        meta = step()
        for i in hooks:
            worker.save_layer(names(worker)[i], meta)
        worker.save(meta)
        if copies is not None:
            copies.release()
        assert all_reported(worker, {"a", "b"})
        stats = worker.stats()
        if not hooks:
            assert served(worker, A[:64]).shape[2] == 64  # whole chunks, as with the mode off
            assert stats["layerwise_saves"] == 0 and stats["layerwise_save_skips"] == 0
            return
        assert served(worker, A[:64]).shape[2] == 0
        assert served(worker, B[:32]).shape[2] == 0
        assert stats["layerwise_saves"] == 0 and stats["layerwise_save_skips"] == 2
        assert worker._drain is not None and worker._drain.in_flight() == 0
        # The next step saves layer by layer again, from the same (given back) buffer.
        meta = step()
        for name in names(worker):
            worker.save_layer(name, meta)
        worker.save(meta)
        assert eventually(lambda: served(worker, A[:64]).shape[2] == 64)
        assert worker.stats()["layerwise_saves"] == 2
    finally:
        if copies is not None:
            copies.release()
        worker.close()


def test_host_kv_is_gathered_in_each_layers_hook(host_worker: WorkerSide) -> None:
    """vLLM's CPU build: a layer's KV is read in its own hook (what wait_for_save stores is
    what each layer held right after it computed), with no device buffer and no copy."""
    worker = host_worker
    assert worker.paged is not None
    fill(worker, A_BLOCKS + B_BLOCKS, seed=71)
    meta = step()
    first, second = names(worker)
    worker.save_layer(first, meta)
    kept = worker.paged.layers[0][A_BLOCKS].clone()
    worker.paged.layers[0][A_BLOCKS] = 0.0  # after its hook: not what the save holds
    worker.save_layer(second, meta)
    worker.paged.layers[0][A_BLOCKS] = kept
    worker.save(meta)
    want = whole_chunk_payloads()
    assert torch.equal(served(worker, A[:64]), want["a"])
    assert torch.equal(served(worker, B[:32]), want["b"])
    assert worker.stats()["layerwise_saves"] == 2
    assert worker.scratch_tokens == 0  # nothing outside vLLM's budget on a host


def test_a_save_that_cannot_be_whole_is_skipped_as_ever(host_worker: WorkerSide) -> None:
    """A range with vLLM's null block (a sliding window dropped it): not in the plan, and
    not saved whole-chunk either; the step's other save still goes layer by layer."""
    worker = host_worker
    fill(worker, A_BLOCKS + B_BLOCKS, seed=73)
    meta = KVTierMetadata(
        saves=[
            SaveSpec("a", A[:64], [0, *A_BLOCKS[1:]], 0, 64),
            SaveSpec("b", B[:32], B_BLOCKS, 0, 32),
        ]
    )
    for name in names(worker):
        worker.save_layer(name, meta)
    worker.save(meta)
    assert served(worker, A[:64]).shape[2] == 0
    assert served(worker, B[:32]).shape[2] == 32
    assert worker.stats()["layerwise_saves"] == 1
