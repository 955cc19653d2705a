"""The transformers connector's layer-wise loads (``layerwise=True``): outputs equal those with
layer-wise off and with no cache at all; each layer waits for its own copy only, the next
layer's copy is queued while it computes; a late or failed layer makes the request a miss
(recomputed, same tokens).

"Device" memory on a CPU host is :class:`tests.memory.late_copies.LateCopies`' marked memory:
its copies land when the test releases them (or when code waits on their fence), never by a
timer."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from kvtier import Engine
from kvtier.demo.tiny_models import build_config, build_model
from kvtier.integrations.transformers import HFConnector
from kvtier.memory.device import Direction, Landed
from tests.integrations.oracle import CHUNK, make_engine, reference, tiny_model, tokens
from tests.memory.late_copies import LateCopies

NEW = 8
LAYERS = 4


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    opened: list[Engine] = []
    yield opened
    for engine in opened:
        assert engine.leaks() == []
        engine.flush(10)
        assert engine.check_invariants() == []
        engine.close()


@pytest.fixture(scope="module")
def deep_model() -> Any:
    """The tiny llama with 4 layers: room for "layer i+1 copies while layer i computes"."""
    config = build_config("llama", "tiny")
    config.num_hidden_layers = LAYERS
    return build_model("llama", "tiny", seed=7, config=config)


def connect(engines: list[Engine], model: Any, **kwargs: Any) -> HFConnector:
    engine = make_engine(model)
    engines.append(engine)
    return HFConnector(engine, model, **kwargs)


def hook_layers(model: Any, before: Callable[[int], None], after: Callable[[int], None]) -> Any:
    """Call ``before(i)`` / ``after(i)`` around decoder layer ``i``; returns the handles."""
    handles = []
    for i, layer in enumerate(model.model.layers):
        handles.append(layer.register_forward_pre_hook(lambda *_, i=i: before(i)))
        handles.append(layer.register_forward_hook(lambda *_, i=i: after(i)))
    return handles


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("copies", ["host", "late"])
def test_layerwise_outputs_equal_layerwise_off_and_no_cache(
    engines: list[Engine], family: str, copies: str
) -> None:
    model = tiny_model(family, torch.float32)
    engine_copies = LateCopies(everything=True) if copies == "late" else None
    on = connect(engines, model, layerwise=True, copies=engine_copies)
    off = connect(engines, model)
    assert on.layerwise is not None and on.layerwise.via_slots == (copies == "late")
    base = tokens(5 * CHUNK + 7, seed=1)
    branch = torch.cat([base[: 3 * CHUNK + 9], tokens(40, seed=2)])
    longer = torch.cat([base, tokens(30, seed=3)])
    for prompt, reused in ((base, 0), (branch, 3 * CHUNK), (longer, 5 * CHUNK)):
        want, want_logits = reference(model, prompt, NEW)
        got_on, got_off = on.generate(prompt, NEW), off.generate(prompt, NEW)
        assert got_on.tokens == got_off.tokens == want
        assert got_on.reused_tokens == got_off.reused_tokens == reused
        logits = on.prefill(prompt).logits
        torch.testing.assert_close(logits.float(), want_logits.float(), atol=1e-5, rtol=0)
    assert on.layerwise.failures == 0
    assert on.layerwise.loads == 5  # every generate and prefill but the first one's
    if copies == "late":
        assert on.layerwise.scratch_bytes > 0  # two one-layer slots, not the whole hit
        assert engine_copies is not None and engine_copies.batches == 5 * 2  # 2 layers each


def test_each_layer_waits_for_its_own_copy_while_the_next_one_is_queued(
    engines: list[Engine], deep_model: Any
) -> None:
    """Copies land only when the test releases them, just before each layer runs: a load
    that waited for more than its layer's copy (or for all of them before the forward) would
    never see it land and fail as late; layer i+1's copy is queued, not landed, while layer i
    computes."""
    late = LateCopies(waits_land=False, everything=True)
    conn = connect(engines, deep_model, layerwise=True, copies=late, late_after_s=5.0)
    prompt = tokens(4 * CHUNK + 5, seed=21)
    want, _ = reference(deep_model, prompt, NEW)
    assert conn.generate(prompt, NEW).tokens == want  # cold: stores 4 chunks

    seen: list[tuple[int, int, int]] = []
    handles = hook_layers(
        deep_model,
        before=lambda i: late.release(),  # lands layer i's copy: queued when i-1 asked
        after=lambda i: seen.append((i, late.batches, late.pending())),
    )
    try:
        got = conn.generate(prompt, NEW)
    finally:
        for handle in handles:
            handle.remove()
    assert got.reused_tokens == 4 * CHUNK and got.tokens == want
    assert conn.layerwise is not None and conn.layerwise.failures == 0
    # While layer i computed, layers 0..i+1 had been queued and only i+1's was still held.
    prefill = seen[:LAYERS]
    assert prefill == [(i, min(i + 2, LAYERS), int(i + 1 < LAYERS)) for i in range(LAYERS)]


@pytest.mark.parametrize("layer", [0, 2])
def test_a_late_layer_makes_the_whole_request_a_miss(
    engines: list[Engine], deep_model: Any, layer: int
) -> None:
    late = LateCopies(waits_land=False, everything=True)
    conn = connect(engines, deep_model, layerwise=True, copies=late, late_after_s=0.2)
    prompt = tokens(3 * CHUNK + 9, seed=22)
    want, _ = reference(deep_model, prompt, NEW)
    conn.generate(prompt, NEW)
    held = {layer}
    handles = hook_layers(
        deep_model, before=lambda i: None if i in held else late.release(), after=lambda i: None
    )
    try:
        got = conn.generate(prompt, NEW)
        assert got.hit_tokens == 3 * CHUNK
        assert got.reused_tokens == 0  # recomputed: nothing of the cached prefix was kept
        assert got.tokens == want
        assert conn.layerwise is not None and conn.layerwise.failures == 1
        late.release()  # the given-up copy lands at last; the next load may reuse its slot
        held.clear()
        again = conn.generate(prompt, NEW)
    finally:
        for handle in handles:
            handle.remove()
    assert again.reused_tokens == 3 * CHUNK and again.tokens == want
    assert conn.layerwise.failures == 1


class FailingCopies(LateCopies):
    """Late copies whose ``fail_at``-th load batch (1, 2, ...) raises as a device copy does."""

    def __init__(self, fail_at: int) -> None:
        super().__init__(everything=True)
        self.fail_at = fail_at
        self.loads = 0

    def submit(
        self, direction: Direction, copies: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> Landed:
        if direction is Direction.LOAD and copies:
            self.loads += 1
            if self.loads == self.fail_at:
                raise RuntimeError("CUDA error: an illegal memory access (injected)")
        return super().submit(direction, copies)


@pytest.mark.parametrize("fail_at", [1, 3, LAYERS])
def test_a_failed_layer_copy_recomputes_with_the_same_tokens(
    engines: list[Engine], deep_model: Any, fail_at: int
) -> None:
    failing = FailingCopies(fail_at)
    conn = connect(engines, deep_model, layerwise=True, copies=failing)
    prompt = tokens(2 * CHUNK + 3, seed=23)
    want, _ = reference(deep_model, prompt, NEW)
    assert conn.generate(prompt, NEW).tokens == want
    got = conn.generate(prompt, NEW)
    assert got.hit_tokens == 2 * CHUNK and got.reused_tokens == 0 and got.tokens == want
    assert conn.layerwise is not None and conn.layerwise.failures == 1
    again = conn.generate(prompt, NEW)  # the next load has no failure injected
    assert again.reused_tokens == 2 * CHUNK and again.tokens == want


def test_a_model_without_a_cache_ignores_layerwise() -> None:
    plain = HFConnector(None, tiny_model("llama", torch.float32), layerwise=True)
    assert plain.layerwise is None


@pytest.mark.gpu
def test_layerwise_on_cuda_gives_the_tokens_of_the_model_alone(engines: list[Engine]) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")  # the gpu marker's skip: runs only where a GPU exists
    cuda_model = copy.deepcopy(tiny_model("llama", torch.float32)).to("cuda")
    conn = connect(engines, cuda_model, layerwise=True)
    base = tokens(3 * CHUNK + 4, seed=15)
    want, _ = reference(cuda_model, base, NEW)
    assert conn.generate(base, NEW).tokens == want
    again = conn.generate(base, NEW)
    assert again.reused_tokens == 3 * CHUNK and again.tokens == want
    assert conn.layerwise is not None and conn.layerwise.via_slots
    assert conn.layerwise.scratch_bytes > 0 and conn.layerwise.failures == 0
