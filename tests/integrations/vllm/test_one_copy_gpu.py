"""The one-copy path on a GPU (integrations/vllm/one_copy.py): the compiled kernel gathers
vLLM's blocks straight into the engine's pinned pages and scatters them back, with CUDA
fences, behind a busy stream. No vLLM here (a GPU machine may lack it): the caches are built
as vLLM's allocator views them, and the specs carry the fields the path reads.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvtier.bench.paged import VLLM_ORDERS, vllm_caches
from kvtier.config import Config
from kvtier.engine import Engine
from kvtier.integrations.vllm.one_copy import OneCopy
from kvtier.integrations.vllm.paged import PagedKV
from kvtier.memory.device import CopyBatch, CopyEngine, DeviceCopies, Direction, Landed
from kvtier.tokens import as_token_array

LAYERS, BLOCK, BLOCKS, HEADS, DIM, CHUNK = 4, 16, 24, 2, 64, 64


class CountingCopies(CopyEngine):
    """kvtier's device copies, counted (the one-copy path makes none)."""

    def __init__(self) -> None:
        self.inner = DeviceCopies()
        self.bytes = 0

    def begin(self, device_side: torch.Tensor, direction: Direction) -> CopyBatch:
        return _Counted(self, self.inner.begin(device_side, direction))


class _Counted(CopyBatch):
    def __init__(self, engine: CountingCopies, inner: CopyBatch) -> None:
        self._engine, self._inner = engine, inner

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._engine.bytes += dst.numel() * dst.element_size()
        self._inner.copy(dst, src)

    def close(self) -> Landed:
        return self._inner.close()


def busy_stream() -> None:
    """Queue a few hundred ms of matmuls on the current stream."""
    a = torch.randn(2048, 2048, device="cuda")
    for _ in range(40):
        a = a @ a
        a = a / a.norm()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("order", ["LBHNC", "BLHNC", "LHBNC"])
def test_on_a_gpu_a_save_and_a_load_copy_once_with_no_scratch(order: str) -> None:
    kv = vllm_caches(
        VLLM_ORDERS[order],
        layers=LAYERS,
        blocks=BLOCKS,
        heads=HEADS,
        block=BLOCK,
        content=2 * DIM,
        dtype=torch.bfloat16,
        device=torch.device("cuda"),
    )
    paged = PagedKV.from_vllm(kv, block_size=BLOCK, num_kv_heads=HEADS, head_dim=DIM)
    layout = paged.layout()
    chunk_bytes = layout.chunk_bytes(CHUNK)
    config = Config.load(
        overrides={"chunk_size": CHUNK, "max_local_cpu_size": f"{16 * chunk_bytes}B"}, env={}
    )
    copies = CountingCopies()
    with Engine(config, layout, model_name="gpu-one-copy", copies=copies) as engine:
        paged, one = OneCopy.build(engine, paged, states=False, force=None)
        assert one is not None  # CUDA, Triton, pinned pages: taken without being asked
        tokens = list(range(1000, 1128))  # 2 chunks
        src, dst = list(range(1, 9)), list(range(12, 20))
        busy_stream()
        for layer in paged.layers:  # written on the stream, behind the matmuls
            layer[src] = torch.randn(layer[src].shape, device="cuda").to(layer.dtype)
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()

        array = as_token_array(tokens)
        save = SimpleNamespace(request_id="w", tokens=tokens, start=0, cache_salt=None)
        one.save(save, src, array, engine.request_keys(array, "w"), None)  # type: ignore[arg-type]
        cpu = engine.tier("cpu")
        assert cpu is not None and len(cpu) == 2  # type: ignore[arg-type]

        engine.lookup(tokens, "r")
        load = SimpleNamespace(request_id="r", tokens=tokens, start=0, end=128, cache_salt=None)
        assert one.load(load, dst) == 128  # type: ignore[arg-type]
        engine.end_request("r")  # waits for the scatter's fence before the pages go back
        torch.cuda.synchronize()
        scratch = torch.cuda.max_memory_allocated() - before

        for layer in paged.layers:
            got, want = layer[dst].contiguous(), layer[src].contiguous()
            assert torch.equal(got.view(torch.int16), want.view(torch.int16))
        assert copies.bytes == 0  # the kernel moved every byte, once each way
        assert scratch < chunk_bytes  # slot offsets only: never a chunk of KV
        assert engine.leaks() == [] and engine.check_invariants() == []
