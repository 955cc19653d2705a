"""The one-copy path (integrations/vllm/one_copy.py) on a CPU host: the worker forced onto it
(``one_copy=True``), the Triton kernel under its interpreter (``TRITON_INTERPRET=1``, set
before the kernel module is imported, as test_paged_kernel.py does), a real Engine, the
scheduler's real lookup channel.

Each byte crosses once: the kernel gathers vLLM's blocks straight into the CPU tier's pages
and scatters them back from there. A counting copy engine sees every copy kvtier makes
between a tensor and a page (it sees none), a spy on the kernel's launches counts the bytes
it moves (each payload byte once per direction), and the worker's scratch stays at 0. The
fences are events the test releases: a page is neither published (save) nor given back
(load) before the kernel's fence.
"""

from __future__ import annotations

import importlib
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch

from kvtier.bench.paged import VLLM_ORDERS, vllm_caches
from kvtier.config import Config
from kvtier.integrations.vllm.groups import ModelGroups, VllmGroup
from kvtier.integrations.vllm.metadata import KVTierMetadata, LoadSpec, SaveSpec
from kvtier.integrations.vllm.worker import WorkerSide
from kvtier.layout import GroupKind
from kvtier.memory.device import LANDED, CopyBatch, CopyEngine, Direction, Landed
from kvtier.storage.cpu import CpuTier
from tests.integrations.vllm.worker_helpers import scheduler_for

pytest.importorskip("triton")

MODULE = "kvtier.integrations.vllm.paged_kernel"
LAYERS, HEADS, DIM, BLOCK, BLOCKS, CHUNK = 2, 2, 8, 16, 32, 32
LATENT = 24  # a small MLA latent: the interpreter is slow
LAYOUTS = (*VLLM_ORDERS, "kv-first", "mla")


@pytest.fixture(scope="module")
def kernel_module() -> Iterator[ModuleType]:
    """The kernel module decorated under the interpreter, for this module's tests only."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        sys.modules.pop(MODULE, None)
        module = importlib.import_module(MODULE)
        yield module
    sys.modules.pop(MODULE, None)


class CountingCopies(CopyEngine):
    """Copies at once, as the host engine does, and counts the bytes of every copy."""

    def __init__(self) -> None:
        self.bytes = 0

    def begin(self, device_side: torch.Tensor, direction: Direction) -> CopyBatch:
        return _CountingBatch(self)


class _CountingBatch(CopyBatch):
    def __init__(self, engine: CountingCopies) -> None:
        self._engine = engine

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)
        self._engine.bytes += dst.numel() * dst.element_size()

    def close(self) -> Landed:
        return LANDED


class KernelBytes:
    """Bytes the kernel's launches moved, per direction."""

    def __init__(self) -> None:
        self.gathered = 0
        self.scattered = 0


@pytest.fixture
def kernel_bytes(kernel_module: ModuleType, monkeypatch: pytest.MonkeyPatch) -> KernelBytes:
    counts = KernelBytes()
    launch = kernel_module.PagedKernel._launch

    def counted(self: object, gather: bool, offsets: torch.Tensor, rows: torch.Tensor) -> None:
        launch(self, gather, offsets, rows)
        moved = rows.numel() * rows.element_size()
        if gather:
            counts.gathered += moved
        else:
            counts.scattered += moved

    monkeypatch.setattr(kernel_module.PagedKernel, "_launch", counted)
    return counts


def caches(name: str) -> tuple[dict[str, torch.Tensor], int, int]:
    """vLLM's KV tensors for layout ``name`` (as its allocator views them), its KV heads and
    head dim."""
    dtype, cpu = torch.bfloat16, torch.device("cpu")
    if name == "kv-first":
        shape = (2, BLOCKS, BLOCK, HEADS, DIM)
        kv = {f"layers.{i}.attn": torch.zeros(shape, dtype=dtype) for i in range(LAYERS)}
        return kv, HEADS, DIM
    heads, dim, content = (1, LATENT, LATENT) if name == "mla" else (HEADS, DIM, 2 * DIM)
    order = VLLM_ORDERS.get(name, VLLM_ORDERS["LBHNC"])
    kv = vllm_caches(
        order, layers=LAYERS, blocks=BLOCKS, heads=heads, block=BLOCK, content=content,
        dtype=dtype, device=cpu,
    )  # fmt: skip
    for tensor in kv.values():
        tensor.zero_()  # torch.empty: vLLM's blocks a load must not touch stay zero
    return kv, heads, dim


def make_worker(name: str, copies: CopyEngine | None = None, **overrides: object) -> WorkerSide:
    kv, heads, dim = caches(name)
    mla = name == "mla"
    groups = ModelGroups(
        (VllmGroup(GroupKind.MLA, 0, tuple(kv), "MLAAttentionSpec", BLOCK),) if mla else ()
    )
    chunk_bytes = (1 if mla else 2) * LAYERS * CHUNK * heads * dim * 2
    values = {"chunk_size": CHUNK, "max_local_cpu_size": f"{8 * chunk_bytes}B", **overrides}
    side = WorkerSide(
        Config.load(overrides=values, env={}),
        model_name=f"tiny-{name}",
        engine_id=f"test-one-copy-{uuid.uuid4().hex}",
        tp_rank=0,
        tp_world_size=1,
        block_size=BLOCK,
        num_kv_heads=heads,
        head_dim=dim,
        groups=groups if mla else None,
        copies=copies,
        one_copy=True,
    )
    side.register(kv)
    return side


def blocks(worker: WorkerSide, layer: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """The raw bits of ``ids``' blocks of one layer (int16: NaN payloads compare too)."""
    assert worker.paged is not None
    bits = layer.view(torch.int16)
    return bits[:, ids] if worker.paged.kv_first else bits[ids]


def fill(worker: WorkerSide, ids: list[int], seed: int) -> None:
    """Random bits (any bf16 pattern, NaNs included) into ``ids``' blocks of every layer."""
    assert worker.paged is not None
    gen = torch.Generator().manual_seed(seed)
    for layer in worker.paged.layers:
        bits = layer.view(torch.int16)
        part = bits[:, ids] if worker.paged.kv_first else bits[ids]
        random = torch.randint(-(2**15), 2**15, part.shape, generator=gen, dtype=torch.int16)
        if worker.paged.kv_first:
            bits[:, ids] = random
        else:
            bits[ids] = random


def load_step(worker: WorkerSide, rid: str, tokens: list[int], dst: list[int]) -> SimpleNamespace:
    """vLLM's SchedulerOutput for ``rid`` with vLLM's own first block computed."""
    return SimpleNamespace(
        preempted_req_ids=set(),
        scheduled_new_reqs=[
            SimpleNamespace(
                req_id=rid, prompt_token_ids=tokens, block_ids=(dst,), num_computed_tokens=16
            )
        ],
        num_scheduled_tokens={rid: 16},
        scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
    )


@pytest.mark.parametrize("name", LAYOUTS)
def test_save_then_load_moves_each_byte_once_through_the_kernel(
    name: str, kernel_bytes: KernelBytes
) -> None:
    copies = CountingCopies()
    worker = make_worker(name, copies)
    scheduler = scheduler_for(worker)
    try:
        assert worker.paged is not None and worker.engine is not None
        token_bytes = worker.paged.layout().token_bytes()
        tokens = list(range(100, 180))  # 80 tokens: 2 whole chunks + 16
        src, dst = [3, 4, 5, 6, 7], [20, 21, 22, 23, 24]
        fill(worker, src, seed=1)
        worker.save(KVTierMetadata(saves=[SaveSpec("r1", tokens[:64], src, 0, 64)]))
        assert kernel_bytes.gathered == 64 * token_bytes  # straight into the pages
        cpu = worker.engine.tier("cpu")
        assert isinstance(cpu, CpuTier) and len(cpu) == 2

        request = SimpleNamespace(request_id="r2", prompt_token_ids=tokens)
        assert scheduler.num_new_matched_tokens(request, 16) == (48, False)
        scheduler.after_alloc(request, dst, 48)
        meta = scheduler.build_meta(load_step(worker, "r2", tokens, dst))
        assert meta.loads == [LoadSpec("r2", tokens, dst, 16, 64)]
        worker.load(meta)
        for layer in worker.paged.layers:
            assert torch.equal(blocks(worker, layer, dst[1:4]), blocks(worker, layer, src[1:4]))
            assert not blocks(worker, layer, dst[:1]).any()  # vLLM's own block: untouched
        assert worker.failed_blocks() == set() and worker.short_loads() == {}
        assert kernel_bytes.scattered == 48 * token_bytes  # tokens 16..63, from the pages

        assert copies.bytes == 0  # no copy_ of the payload: the kernel moved every byte
        stats = worker.stats()
        assert (stats["scratch_tokens"], stats["scratch_bytes"]) == (0, 0)
        assert stats["one_copy"] == 1
        scheduler.finished("r2")
        assert worker.engine.leaks() == [] and worker.engine.check_invariants() == []
    finally:
        scheduler.close()
        worker.close()


def test_disk_hits_land_in_pages_and_reach_the_blocks_through_the_kernel(
    tmp_path: Path, kernel_bytes: KernelBytes
) -> None:
    """A hit on disk only (a restart): the loader thread fetches it into pages of the pool,
    and the kernel scatters from there; still no device scratch, no payload copy_."""
    disk = {"local_disk": str(tmp_path), "max_local_disk_size": f"{1 << 20}B"}
    tokens = list(range(500, 580))
    first = make_worker("BLHNC", **disk)
    fill(first, [3, 4, 5, 6], seed=4)
    first.save(KVTierMetadata(saves=[SaveSpec("w", tokens[:64], [3, 4, 5, 6], 0, 64)]))
    assert first.paged is not None
    want = [blocks(first, layer, [3, 4, 5, 6]).clone() for layer in first.paged.layers]
    first.close()  # drains the disk writes

    copies = CountingCopies()
    second = make_worker("BLHNC", copies, **disk)  # CPU empty, the disk index rebuilt
    scheduler = scheduler_for(second)
    try:
        request = SimpleNamespace(request_id="r", prompt_token_ids=tokens)
        assert scheduler.num_new_matched_tokens(request, 0) == (64, True)
        dst = [10, 11, 12, 13, 14]
        scheduler.after_alloc(request, dst, 64)
        out = SimpleNamespace(
            preempted_req_ids=None,
            scheduled_new_reqs=[],
            num_scheduled_tokens={},
            scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
        )
        second.load(scheduler.build_meta(out))
        deadline, done = time.monotonic() + 30, set[str]()
        while "r" not in done and time.monotonic() < deadline:
            done |= second.finished_loads()
            time.sleep(0.01)
        assert done == {"r"} and second.failed_blocks() == set()
        assert second.paged is not None
        for layer, expected in zip(second.paged.layers, want, strict=True):
            assert torch.equal(blocks(second, layer, dst[:4]), expected)
        assert copies.bytes == 0 and second.stats()["scratch_tokens"] == 0
        scheduler.finished("r")
        assert second.engine is not None
        assert second.engine.leaks() == [] and second.engine.check_invariants() == []
    finally:
        scheduler.close()
        second.close()


class Gate:
    """A fence the test lands itself (``open``), instead of racing a timer."""

    def __init__(self) -> None:
        self.opened = threading.Event()

    def __call__(self) -> Landed:
        return self

    def wait(self) -> None:
        assert self.opened.wait(30), "the test never landed its fence"

    def done(self) -> bool:
        return self.opened.is_set()


def test_a_load_gives_its_pages_back_only_after_the_kernels_fence(
    kernel_module: ModuleType,
) -> None:
    worker = make_worker("LBHNC")
    try:
        assert worker.engine is not None and worker._one_copy is not None
        tokens = list(range(64))
        fill(worker, [1, 2, 3, 4], seed=5)
        worker.save(KVTierMetadata(saves=[SaveSpec("a", tokens, [1, 2, 3, 4], 0, 64)]))
        worker.engine.lookup(tokens, "b")
        gate = Gate()
        worker._one_copy.fence = gate
        worker.load(KVTierMetadata(loads=[LoadSpec("b", tokens, [9, 10, 11, 12], 0, 64)]))
        ender = threading.Thread(target=worker.engine.end_request, args=("b",))
        ender.start()
        ender.join(0.5)
        assert ender.is_alive()  # the end waits: the kernel may still read the pages
        gate.opened.set()
        ender.join(10)
        assert not ender.is_alive()
        assert worker.engine.leaks() == [] and worker.engine.check_invariants() == []
    finally:
        worker.close()


def test_a_save_publishes_its_pages_only_after_the_kernels_fence(
    kernel_module: ModuleType,
) -> None:
    worker = make_worker("LBHNC")
    try:
        assert worker.engine is not None and worker._one_copy is not None
        cpu = worker.engine.tier("cpu")
        assert isinstance(cpu, CpuTier)
        gate = Gate()
        worker._one_copy.fence = gate
        fill(worker, [1, 2, 3, 4], seed=6)
        meta = KVTierMetadata(saves=[SaveSpec("a", list(range(64)), [1, 2, 3, 4], 0, 64)])
        saver = threading.Thread(target=worker.save, args=(meta,))
        saver.start()
        saver.join(0.5)
        assert saver.is_alive() and len(cpu) == 0  # nothing published before it landed
        gate.opened.set()
        saver.join(10)
        assert not saver.is_alive() and len(cpu) == 2
        assert worker.engine.leaks() == [] and worker.engine.check_invariants() == []
    finally:
        worker.close()


def test_a_trimmed_sliding_group_keeps_the_two_copy_path() -> None:
    """A sliding group that keeps only its window packs a page by group: the page is not the
    chunk tensor the kernel addresses, so the worker copies through its buffer as before."""
    names = ("layers.0.attn", "layers.1.attn")
    groups = ModelGroups(
        (
            VllmGroup(GroupKind.SLIDING, 16, names[:1], "SlidingWindowSpec", BLOCK),
            VllmGroup(GroupKind.FULL, 0, names[1:], "FullAttentionSpec", BLOCK),
        )
    )
    kv, _, _ = caches("LBHNC")
    side = WorkerSide(
        Config.load(overrides={"chunk_size": 64, "max_local_cpu_size": "1MB"}, env={}),
        model_name="tiny-hybrid",
        engine_id=f"test-one-copy-{uuid.uuid4().hex}",
        tp_rank=0,
        tp_world_size=1,
        block_size=BLOCK,
        num_kv_heads=HEADS,
        head_dim=DIM,
        groups=groups,
        one_copy=True,
    )
    side.register(kv)
    try:
        assert side.cache is not None and side.cache.layout.trims
        assert side.stats()["one_copy"] == 0 and side._loads is not None
        assert side._loads.one_copy is None
    finally:
        side.close()
