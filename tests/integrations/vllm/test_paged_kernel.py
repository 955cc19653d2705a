"""The Triton gather/scatter kernel against the torch path, bit for bit, on CPU tensors.

The kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, read when a kernel is
decorated, so the kernel module is imported afresh with it set, and dropped again after).
Every layout vLLM 0.32 can hand a connector is built by vLLM's own allocator
(``allocate_kv_cache`` for each ``KVCacheLayout``: one per stride order, layer- or
block-outermost), plus the classic kv-first tensor, MLA latents and hybrid sliding/full
groups with vLLM's null block. The bytes are random, NaN payloads included: the kernel moves
integers, so nothing may be canonicalised on the way. Shapes are small: the interpreter is
slow.
"""

from __future__ import annotations

import importlib
import random
import sys
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

from kvtier.bench.paged import VLLM_ORDERS
from kvtier.bench.paged import vllm_caches as bench_caches
from kvtier.integrations.vllm.paged import PagedKV
from kvtier.layout import GroupKind

pytest.importorskip("triton")
layouts = pytest.importorskip("vllm.v1.kv_cache_layout")
interface = pytest.importorskip("vllm.v1.kv_cache_interface")
worker_utils = pytest.importorskip("vllm.v1.worker.utils")

MODULE = "kvtier.integrations.vllm.paged_kernel"
BLOCK, BLOCKS, HEADS, DIM = 16, 10, 2, 8


@pytest.fixture(scope="module", autouse=True)
def interpreted() -> Iterator[ModuleType]:
    """The kernel module decorated under the interpreter, for this module's tests only."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        sys.modules.pop(MODULE, None)
        module = importlib.import_module(MODULE)
        yield module
    sys.modules.pop(MODULE, None)


def vllm_caches(
    layout: object,
    spec: object,
    groups: list[list[str]],
    *,
    kernel_block: int | None = None,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """One layer view per name, as vLLM's worker allocates them (groups overlay the same
    bytes, as vLLM's hybrid allocator makes them), filled with random bytes."""
    per_group = len(groups[0])
    page = spec.page_size_bytes  # type: ignore[attr-defined]
    outermost = layout.is_block_outermost  # type: ignore[attr-defined]
    fixed = (None, page * per_group if outermost else None, None, None, None)
    layer_stride, block_stride, *_ = interface.compute_layout_strides(
        spec, BLOCKS, per_group, layout, fixed_strides=fixed
    )
    size = page * per_group * BLOCKS
    tensors = [interface.KVCacheTensor(size, names, layer_stride, block_stride) for names in groups]
    specs = [interface.KVCacheGroupSpec(names, spec) for names in groups]
    config = interface.KVCacheConfig(BLOCKS, tensors, specs)
    sizes = [kernel_block] * len(groups) if kernel_block else None
    kv = worker_utils.allocate_kv_cache(config, torch.device("cpu"), layout, sizes)
    storage = next(iter(kv.values())).untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8).set_(storage)  # the whole allocation, as bytes
    flat.copy_(torch.randint(0, 256, (size,), generator=torch.Generator().manual_seed(seed)))
    return kv


def full_spec(dtype: torch.dtype = torch.bfloat16) -> object:
    return interface.FullAttentionSpec(BLOCK, num_kv_heads=HEADS, head_size=DIM, dtype=dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(ints), b.view(ints))


def snapshot(kv: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return [t.clone() for t in kv.values()]


def check_both_ways(
    kv: dict[str, torch.Tensor], make: object, tables: object, start: int, end: int
) -> None:
    """Gather and scatter through the kernel equal the torch path, bit for bit; a scatter
    writes only where the torch path does (the null block stays as it was)."""
    torch_path = make(kv)  # type: ignore[operator]
    kernel_path = torch_path.with_kernel()
    assert torch_path.kernel is None and kernel_path.kernel is not None
    layout = torch_path.layout()
    dtype, base = layout.dtype, start // 8 * 8
    want, got = (torch.zeros(layout.kv_shape(end - base + 3), dtype=dtype) for _ in range(2))
    torch_path.gather(tables, start, end, want, base)
    kernel_path.gather(tables, start, end, got, base)
    assert same_bits(got, want)
    # Scatter fresh bytes both ways into copies of the same cache.
    src = torch.randint(0, 256, (want.numel() * want.element_size(),), dtype=torch.uint8)
    src = src.view(dtype).view(want.shape)
    before = snapshot(kv)
    torch_path.scatter(tables, start, end, src, base)
    by_torch = snapshot(kv)
    for tensor, old in zip(kv.values(), before, strict=True):
        tensor.copy_(old)
    kernel_path.scatter(tables, start, end, src, base)
    for tensor, expected in zip(kv.values(), by_torch, strict=True):
        assert same_bits(tensor, expected)
    assert any(not same_bits(t, b) for t, b in zip(by_torch, before, strict=True))


ALL_LAYOUTS = list(layouts.KVCacheLayout)


def test_the_bench_and_gpu_tests_build_the_layouts_vllm_builds() -> None:
    """The GPU machine has no vLLM: its tensors come from the bench's builder, which must
    give every layer the strides (and the place in one allocation) vLLM's allocator does."""
    assert {x.name: x.stride_order for x in ALL_LAYOUTS} == VLLM_ORDERS
    names = ["a", "b", "c"]
    for layout in ALL_LAYOUTS:
        theirs = vllm_caches(layout, full_spec(), [names])
        ours = bench_caches(
            VLLM_ORDERS[layout.name],
            layers=3,
            blocks=BLOCKS,
            heads=HEADS,
            block=BLOCK,
            content=2 * DIM,
            dtype=torch.bfloat16,
            device=torch.device("cpu"),
        )
        base = {"theirs": theirs["a"].data_ptr(), "ours": ours["layers.0.attn"].data_ptr()}
        for name, mine in zip(names, ours.values(), strict=True):
            assert (theirs[name].shape, theirs[name].stride()) == (mine.shape, mine.stride())
            assert theirs[name].data_ptr() - base["theirs"] == mine.data_ptr() - base["ours"], (
                layout.name
            )


@pytest.mark.parametrize("layout", ALL_LAYOUTS, ids=[x.name for x in ALL_LAYOUTS])
def test_every_vllm_layout_copies_bit_exact(layout: object) -> None:
    names = [f"layers.{i}.attn" for i in range(3)]
    kv = vllm_caches(layout, full_spec(), [names], seed=1)
    assert tuple(kv[names[0]].shape) == (BLOCKS, HEADS, BLOCK, 2 * DIM)

    def make(kv: dict[str, torch.Tensor]) -> PagedKV:
        return PagedKV.from_vllm(kv, block_size=BLOCK, num_kv_heads=HEADS, head_dim=DIM)

    kernel = make(kv).with_kernel().kernel
    assert kernel is not None and kernel.vec == 8  # 16-byte runs: vLLM's strides allow them
    table = random.Random(5).sample(range(1, BLOCKS), 4)
    check_both_ways(kv, make, table, 5, 61)


def test_a_kernel_block_smaller_than_vllms_block_and_fp8_copy_bit_exact() -> None:
    """vLLM splits a manager block into kernel blocks (layer-compact layouts); fp8 bytes."""
    layout = layouts.KVCacheLayout.LBHNC
    kv = vllm_caches(layout, full_spec(torch.float8_e4m3fn), [["a", "b"]], kernel_block=8)
    assert kv["a"].shape[2] == 8

    def make(kv: dict[str, torch.Tensor]) -> PagedKV:
        return PagedKV.from_vllm(kv, block_size=BLOCK, num_kv_heads=HEADS, head_dim=DIM)

    check_both_ways(kv, make, [7, 2, 9], 3, 48)


def test_the_classic_kv_first_tensor_copies_bit_exact() -> None:
    gen = torch.Generator().manual_seed(2)
    shape = (2, BLOCKS, BLOCK, HEADS, DIM)
    kv = {f"l{i}": torch.randn(shape, generator=gen, dtype=torch.float16) for i in range(2)}

    def make(kv: dict[str, torch.Tensor]) -> PagedKV:
        return PagedKV.from_vllm(kv, block_size=BLOCK, num_kv_heads=HEADS, head_dim=DIM)

    assert make(kv).kv_first
    check_both_ways(kv, make, [4, 8, 1, 6], 0, 64)


@pytest.mark.parametrize("flat", [False, True], ids=["[B,1,N,D]", "[B,N,D]"])
def test_mla_latents_copy_bit_exact(flat: bool) -> None:
    """MLA: one latent (here 24 wide, not a power of two) per token; vLLM's MLA spec."""
    latent = 24
    spec = interface.MLAAttentionSpec(BLOCK, num_kv_heads=1, head_size=latent, dtype=torch.bfloat16)
    kv = vllm_caches(layouts.KVCacheLayout.LBHNC, spec, [["m0", "m1", "m2"]], seed=3)
    if flat:
        kv = {name: t[:, 0] for name, t in kv.items()}

    def make(kv: dict[str, torch.Tensor]) -> PagedKV:
        return PagedKV.from_vllm(kv, block_size=BLOCK, num_kv_heads=1, head_dim=latent, mla=True)

    assert make(kv).planes == 1
    check_both_ways(kv, make, [3, 9, 5], 10, 40)


@pytest.mark.parametrize("layout", ALL_LAYOUTS[:1] + ALL_LAYOUTS[3:4], ids=["LBHNC", "BLHNC"])
def test_hybrid_groups_use_their_own_tables_and_never_write_the_null_block(
    layout: object,
) -> None:
    """Gemma-like: sliding-window layers and full layers in two KV-cache groups that overlay
    one allocation; the sliding group's table holds vLLM's null block behind its window."""
    sliding, full = ["l0", "l2"], ["l1", "l3"]
    kv = vllm_caches(layout, full_spec(), [sliding, full], seed=4)
    kv = {name: kv[name] for name in ("l0", "l1", "l2", "l3")}  # model order
    groups = [(GroupKind.SLIDING, 16, sliding), (GroupKind.FULL, 0, full)]

    def make(kv: dict[str, torch.Tensor]) -> PagedKV:
        return PagedKV.from_vllm(
            kv, block_size=BLOCK, num_kv_heads=HEADS, head_dim=DIM, groups=groups
        )

    assert make(kv).num_groups == 2
    tables = ([0, 0, 3, 7], [4, 8, 1, 2])  # disjoint blocks: the groups share the bytes
    check_both_ways(kv, make, tables, 0, 64)


def test_the_paged_bench_runs_every_layout_through_the_kernel_and_checks_its_bytes() -> None:
    """``kvtier bench paged`` with the kernel interpreted: each kind of layout measured three
    ways, and its own bit-exactness check passed (it raises otherwise)."""
    import argparse

    from kvtier.bench import paged

    parser = argparse.ArgumentParser()
    paged.add_arguments(parser)
    small = ["--layers", "2", "--kv-heads", "2", "--head-dim", "8", "--tokens", "40"]
    layouts = ["BLHNC", "kv-first", "mla"]  # one of each kind: the interpreter is slow
    args = parser.parse_args([*small, "--repeats", "1", "--layouts", ",".join(layouts)])
    result = paged.run(args)
    assert result["kernel"] == "triton"
    for name in layouts:
        for way in ("save", "load"):
            for path in ("kernel", "torch"):
                low, mid, high = (
                    result[f"{name}_{way}_{path}_vs_dma{end}"] for end in ("_min", "", "_max")
                )
                assert 0 <= low <= mid <= high  # the interpreter is ~1000x slower: 0.0
