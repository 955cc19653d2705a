"""Layer-wise loads on the worker (``use_layerwise``), with a real Engine and real paged
tensors, without vLLM's processes: each layer's compute waits for its own copy only, the next
layer's copy is queued before the current one is waited for, and a late, failed or skipped
layer turns the request into a miss (kvtier.integrations.vllm.layerwise).

The copies to "device" memory run only when the test releases their batch (:class:`Gated`):
"late" is an event the test controls, not a race against a timer.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from kvtier.integrations.vllm.connector import KVTierConnector
from kvtier.integrations.vllm.layerwise import FAULT_ENV, LayerLoads
from kvtier.integrations.vllm.metadata import KVTierMetadata, LoadSpec, SaveSpec
from kvtier.integrations.vllm.worker import WorkerSide
from kvtier.memory.device import CopyBatch, CopyEngine, DeviceCopies, Direction, Fence
from tests.integrations.vllm.worker_helpers import BLOCK, LAYERS, fill, make_worker, scheduler_for

TOKENS = list(range(100, 180))  # 80 tokens: 2 whole chunks of 32 + 16
SRC = [3, 4, 5, 6, 7]
DST = [20, 21, 22, 23, 24]
LOADED = DST[1:4]  # tokens 16..63: vLLM holds block 0 itself


class _Gate:
    """A batch's fence: its copies run when the test releases it (``lazy``: when someone
    waits for it, so only a reader that waits sees them)."""

    def __init__(self, copies: list[tuple[torch.Tensor, torch.Tensor]], lazy: bool) -> None:
        self._copies = copies
        self._lazy = lazy
        self._landed = threading.Event()

    def release(self) -> None:
        for dst, src in self._copies:
            dst.copy_(src)
        self._landed.set()

    def wait(self) -> None:
        if self._lazy and not self._landed.is_set():
            self.release()
        if not self._landed.wait(30.0):
            raise AssertionError("a gated copy was never released")

    def done(self) -> bool:
        return self._landed.is_set()

    def order_current_stream(self) -> None:
        return None  # no stream: the host waits


class _GatedBatch(CopyBatch):
    def __init__(self, engine: Gated) -> None:
        self._engine = engine
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._copies.append((dst, src))

    def close(self, *, order_caller: bool = True) -> Fence:
        gate = _Gate(self._copies, self._engine.lazy)
        self._engine.gates.append(gate)
        return gate


class Gated(CopyEngine):
    """Copies to or from marked ("device") tensors wait for :meth:`release` (``lazy``: or a
    wait on their fence); others run at once."""

    def __init__(self, *, lazy: bool = False) -> None:
        self._marked: set[int] = set()
        self.gates: list[_Gate] = []
        self.lazy = lazy

    def mark(self, tensor: torch.Tensor) -> torch.Tensor:
        self._marked.add(tensor.untyped_storage().data_ptr())
        return tensor

    def on_device(self, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() in self._marked

    def begin(self, device_side: torch.Tensor, direction: Direction) -> CopyBatch:
        if not self.on_device(device_side):
            return DeviceCopies().begin(device_side, direction)
        return _GatedBatch(self)

    def release(self, n: int) -> None:
        self.gates[n].release()


@pytest.fixture
def worker() -> Iterator[WorkerSide]:
    side = make_worker(use_layerwise=True)
    yield side
    side.close()


def _load_meta(worker: WorkerSide) -> KVTierMetadata:
    """Store 2 chunks under one request, then the step that loads them for another."""
    fill(worker, SRC, seed=1)
    worker.save(KVTierMetadata(saves=[SaveSpec("r1", TOKENS[:64], SRC, 0, 64)]))
    scheduler = scheduler_for(worker)
    request = SimpleNamespace(request_id="r2", prompt_token_ids=TOKENS)
    assert scheduler.num_new_matched_tokens(request, 16) == (48, False)
    scheduler.after_alloc(request, DST, 48)
    new = SimpleNamespace(
        req_id="r2", prompt_token_ids=TOKENS, block_ids=(DST,), num_computed_tokens=16
    )
    step = SimpleNamespace(
        preempted_req_ids=set(),
        scheduled_new_reqs=[new],
        num_scheduled_tokens={"r2": 16},
        scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
    )
    meta = scheduler.build_meta(step)
    assert meta.loads == [LoadSpec("r2", TOKENS, DST, 16, 64)]
    return meta


def _gated(worker: WorkerSide, late_after_s: float = 30.0) -> Gated:
    """Put the worker's layer-wise loads on a gated engine, its KV and slots "device"."""
    assert worker.paged is not None and worker._loads is not None
    gated = Gated()
    for layer in worker.paged.layers:
        gated.mark(layer)
    worker._layers = LayerLoads(
        worker._loads,
        worker.paged,
        gated,
        late_after_s=late_after_s,
        device_memory=lambda shape, dtype, device: gated.mark(torch.zeros(shape, dtype=dtype)),
    )
    return gated


def _names(worker: WorkerSide) -> tuple[str, ...]:
    assert worker.paged is not None
    return worker.paged.layer_names


def _in_thread(call: object) -> threading.Thread:
    assert callable(call)
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    return thread


def test_each_layer_waits_for_its_own_copy_only(worker: WorkerSide) -> None:
    assert LAYERS == 2 and worker.paged is not None
    meta = _load_meta(worker)
    gated = _gated(worker)
    layers = worker.paged.layers
    worker.load(meta)
    assert len(gated.gates) == 1  # layer 0's copy is queued before the forward

    first = _in_thread(lambda: worker.wait_layer(_names(worker)[0]))
    first.join(0.3)
    assert first.is_alive(), "layer 0 computed before its copy landed"
    # Layer 1's copy is on its way while layer 0 still waits (it computes next).
    assert len(gated.gates) == 2
    assert not layers[0][LOADED].any()
    gated.release(0)  # layer 0's copy only
    first.join(10.0)
    assert not first.is_alive(), "layer 0 waited for more than its own copy"
    assert torch.equal(layers[0][LOADED], layers[0][SRC[1:4]])
    assert not layers[1][LOADED].any()  # layer 1's copy has not landed: nothing scattered

    second = _in_thread(lambda: worker.wait_layer(_names(worker)[1]))
    second.join(0.3)
    assert second.is_alive(), "layer 1 computed before its copy landed"
    gated.release(1)
    second.join(10.0)
    assert not second.is_alive()
    assert torch.equal(layers[1][LOADED], layers[1][SRC[1:4]])
    assert not layers[0][DST[0]].any()  # vLLM's own block is never written

    worker.layers_done()
    assert worker.failed_blocks() == set() and worker.short_loads() == {}
    stats = worker.stats()
    assert stats["layerwise_loads"] == 1 and stats["layerwise_failures"] == 0
    # Device scratch: two one-layer slots of the load's 64 rows (2 chunks) = 64 token rows
    # of all layers, counted with the model thread's buffer.
    assert worker._layers is not None and worker._layers.scratch_tokens == 2 * 64 // LAYERS
    assert stats["scratch_tokens"] >= worker._layers.scratch_tokens


class _Ordered:
    """A fence that lands at once and logs when a stream is ordered after it."""

    def __init__(self, log: list[tuple[str, int]], layer: int) -> None:
        self._log = log
        self._layer = layer

    def wait(self) -> None:
        return None

    def done(self) -> bool:
        return True

    def order_current_stream(self) -> None:
        self._log.append(("ordered", self._layer))


class _OrderedBatch(CopyBatch):
    def __init__(self, engine: Ordering) -> None:
        self._engine = engine

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def close(self, *, order_caller: bool = True) -> Fence:
        fence = _Ordered(self._engine.log, self._engine.batches)
        self._engine.batches += 1
        if order_caller:  # what a CUDA LOAD batch does when it closes
            fence.order_current_stream()
        return fence


class Ordering(CopyEngine):
    """A CUDA stream's order, recorded: each LOAD batch into a marked ("device") tensor is
    one layer's copy (batch n: layer n), and the log says when the model's stream was
    ordered after it (at close, as CUDA's default, or later by its fence)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []
        self.batches = 0
        self._marked: set[int] = set()

    def mark(self, tensor: torch.Tensor) -> torch.Tensor:
        self._marked.add(tensor.untyped_storage().data_ptr())
        return tensor

    def on_device(self, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() in self._marked

    def begin(self, device_side: torch.Tensor, direction: Direction) -> CopyBatch:
        if not self.on_device(device_side):
            return DeviceCopies().begin(device_side, direction)
        return _OrderedBatch(self)


def test_each_layers_compute_is_ordered_after_its_own_copy_only(worker: WorkerSide) -> None:
    """On CUDA a fence orders the model's stream: everything queued after that runs after
    the copy. Layer i+1's copy is queued before layer i computes, so its fence must order the
    stream only in layer i+1's own wait, or layer i's compute would wait for it too."""
    assert worker.paged is not None and worker._loads is not None
    meta = _load_meta(worker)
    ordering = Ordering()
    for layer in worker.paged.layers:
        ordering.mark(layer)
    worker._layers = LayerLoads(
        worker._loads,
        worker.paged,
        ordering,
        device_memory=lambda shape, dtype, device: ordering.mark(torch.zeros(shape, dtype=dtype)),
    )
    worker.load(meta)
    for i, name in enumerate(_names(worker)):
        worker.wait_layer(name)
        ordering.log.append(("compute", i))
    worker.layers_done()
    expected = [(what, i) for i in range(LAYERS) for what in ("ordered", "compute")]
    assert ordering.log == expected
    layers = worker.paged.layers
    for layer in layers:
        assert torch.equal(layer[LOADED], layer[SRC[1:4]])
    assert worker.failed_blocks() == set() and worker.short_loads() == {}


def test_a_late_layer_turns_the_request_into_a_miss(worker: WorkerSide) -> None:
    meta = _load_meta(worker)
    gated = _gated(worker, late_after_s=0.2)
    worker.load(meta)
    names = _names(worker)
    gated.release(0)
    worker.wait_layer(names[0])
    worker.wait_layer(names[1])  # its copy is never released: late
    worker.layers_done()
    # The whole request recomputes from its first loaded token, layer 0 included.
    assert worker.short_loads() == {"r2": 16}
    assert worker.failed_blocks() == set(DST[1:4])
    assert worker.stats()["layerwise_failures"] == 1
    gated.release(1)  # the late copy lands; the next load waits for it before reusing slots


@pytest.mark.parametrize("skip", [0, 1])
def test_a_layer_the_forward_never_waited_for_is_a_miss(worker: WorkerSide, skip: int) -> None:
    """vLLM skipped a layer's hook: that layer's KV may be anything, so the request is a
    miss (skip 1: the forward ends without the last layer's wait)."""
    meta = _load_meta(worker)
    worker.load(meta)
    for i, name in enumerate(_names(worker)):
        if i != skip:
            worker.wait_layer(name)
    worker.layers_done()
    assert worker.short_loads() == {"r2": 16}
    assert worker.failed_blocks() == set(DST[1:4])


def test_a_fault_at_layer_k_is_a_miss(worker: WorkerSide, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT_ENV, "1")
    meta = _load_meta(worker)
    worker.load(meta)
    for name in _names(worker):
        worker.wait_layer(name)
    worker.layers_done()
    assert worker.short_loads() == {"r2": 16}
    assert worker.failed_blocks() == set(DST[1:4])


def test_host_kv_loads_layer_by_layer_without_slots(worker: WorkerSide) -> None:
    """A CPU worker (vLLM's CPU build): the scatter reads the host staging, one layer per
    wait, and no device scratch is held."""
    assert worker.paged is not None
    meta = _load_meta(worker)
    layers = worker.paged.layers
    worker.load(meta)
    assert not layers[0][LOADED].any()  # nothing before layer 0's wait
    worker.wait_layer(_names(worker)[0])
    assert torch.equal(layers[0][LOADED], layers[0][SRC[1:4]])
    assert not layers[1][LOADED].any()
    worker.wait_layer(_names(worker)[1])
    assert torch.equal(layers[1][LOADED], layers[1][SRC[1:4]])
    worker.layers_done()
    assert worker.failed_blocks() == set() and worker.short_loads() == {}
    assert worker._layers is not None and worker._layers.scratch_tokens == 0


def test_block_size_is_the_helpers() -> None:
    assert BLOCK == 16  # DST's blocks 1..3 hold tokens 16..63


def test_layer_wise_mode_asks_vllm_for_piecewise_cuda_graphs() -> None:
    """vLLM asks the connector class with kv_connector_extra_config before any instance
    exists; LMCache's key name, with or without kvtier's prefix, and connector keys beside."""
    ask = KVTierConnector.requires_piecewise_for_cudagraph
    assert ask({"use_layerwise": True}) is True
    assert ask({"kvtier.use_layerwise": "true", "async_lower_loads": False}) is True
    assert ask({}) is False  # whole-chunk loads: full CUDA graphs stay allowed
    assert ask({"use_layerwise": False}) is False
