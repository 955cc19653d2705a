"""The Triton kernel compiled for a GPU: picked by ``from_vllm`` on CUDA, and reading and
writing pinned host pages in place (the one-copy path), bit-exact against the torch path.

Apart from the interpreter tests (``test_paged_kernel.py``), which import the kernel module
under ``TRITON_INTERPRET=1``, because these need it compiled. No vLLM here (a GPU machine
may lack it): the caches are built as vLLM's allocator views them
(:func:`kvtier.bench.paged.vllm_caches`, checked against vLLM's own in the interpreter tests).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvtier.bench.paged import VLLM_ORDERS, vllm_caches
from kvtier.integrations.vllm.paged import PagedKV

BLOCK, BLOCKS, HEADS, DIM, TOKENS = 16, 12, 2, 64, 70


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("order", list(VLLM_ORDERS))
def test_on_a_gpu_the_kernel_reads_and_writes_pinned_pages_in_place(order: str) -> None:
    kv = vllm_caches(
        VLLM_ORDERS[order],
        layers=3,
        blocks=BLOCKS,
        heads=HEADS,
        block=BLOCK,
        content=2 * DIM,
        dtype=torch.bfloat16,
        device=torch.device("cuda"),
    )
    for tensor in kv.values():
        tensor.copy_(torch.randn(tensor.shape, device="cuda"))
    pkv = PagedKV.from_vllm(kv, block_size=BLOCK, num_kv_heads=HEADS, head_dim=DIM)
    assert pkv.kernel is not None  # CUDA: the kernel path, without being asked
    torch_path = replace(pkv, kernel=None)
    table = [5, 2, 9, 4, 11]
    shape = pkv.layout().kv_shape(TOKENS + 2)
    pinned = torch.zeros(shape, dtype=torch.bfloat16).pin_memory()
    pkv.gather(table, 1, TOKENS + 1, pinned, base=0)  # straight into the host page
    want = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
    torch_path.gather(table, 1, TOKENS + 1, want, base=0)
    torch.cuda.synchronize()
    assert same_bits(pinned, want.cpu())
    src = torch.randn(shape).to(torch.bfloat16).pin_memory()
    pkv.scatter(table, 1, TOKENS + 1, src, base=0)  # straight from the host page
    back = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
    torch_path.gather(table, 1, TOKENS + 1, back, base=0)
    torch.cuda.synchronize()
    assert same_bits(back[:, :, 1 : TOKENS + 1].cpu(), src[:, :, 1 : TOKENS + 1])
    # A device-side chunk (today's scratch) goes through the kernel too.
    device_rows = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
    pkv.gather(table, 1, TOKENS + 1, device_rows, base=0)
    assert same_bits(device_rows.cpu(), back.cpu())


def test_the_kernels_compile_for_a_hopper_gpu_and_move_16_byte_vectors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No GPU needed: Triton compiles the kernels ahead of time for sm_90 (H100, H200) with
    the specialisations its launcher makes for an 8B-shaped bf16 cache (16-byte aligned
    pointers, strides divisible by 16), which the interpreter never exercises. Every load and
    store of the KV must then be a 128-bit vector (``VEC`` = 8 bf16): a scalar copy of two
    bytes per thread would not reach a pinned DMA's rate over PCIe."""
    import importlib
    import re
    import sys

    compiler = pytest.importorskip("triton.compiler")
    backends = pytest.importorskip("triton.backends.compiler")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    name = "kvtier.integrations.vllm.paged_kernel"
    sys.modules.pop(name, None)
    kernels = importlib.import_module(name)
    args = ["layers", "layer_offsets", "layer_group", "offsets", "chunk", "n", "heads", "head_dim"]
    args += ["s_plane", "s_head", "s_dim", "c_plane", "c_layer", "c_row", "c_col"]
    types = ["*i16", "*i64", "*i32", "*i64", "*i16"] + ["i32"] * 10
    signature = dict(zip(args, types, strict=True))
    signature.update(BLOCK_T="constexpr", BLOCK_H="constexpr", BLOCK_D="constexpr")
    signature.update(VEC="constexpr", GATHER="constexpr")
    aligned = {"layers", "layer_offsets", "layer_group", "offsets", "chunk", "head_dim"}
    aligned |= {"s_plane", "s_head", "c_plane", "c_layer", "c_row"}
    attrs = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(args) if arg in aligned}
    constants = {"BLOCK_T": 4, "BLOCK_H": 8, "BLOCK_D": 128, "VEC": 8, "s_dim": 1, "c_col": 1}
    for gather in (True, False):
        constants["GATHER"] = gather
        source = compiler.ASTSource(kernels._copy, signature, constexprs=constants, attrs=attrs)
        try:
            compiled = compiler.compile(source, target=backends.GPUTarget("cuda", 90, 32))
        except Exception as exc:  # no NVIDIA backend or ptxas in this Triton build
            if "ptxas" in str(exc) or "backend" in str(exc).lower():
                pytest.skip(f"Triton cannot compile for CUDA here: {exc}")
            raise
        ptx = compiled.asm["ptx"]
        assert re.search(r"ld\.global\.v4\.b32", ptx) and re.search(r"st\.global\.v4\.b32", ptx)
        assert not re.search(r"(ld|st)\.global\.b16", ptx), "a two-byte access slipped in"
    sys.modules.pop(name, None)
