"""``kvtier bench paged``: a save and a load between vLLM's paged KV and host pages, per layout.

For each layout a connector can be handed (vLLM 0.32's six ``KVCacheLayout`` stride orders of
``[layers, blocks, heads, block_tokens, K|V]``, the classic kv-first tensor, and an MLA latent),
the same bytes move three ways, alternated in rounds (:func:`kvtier.bench.timing.alternate`)::

    save_kernel   paged blocks --Triton gather--> pinned host page        (one copy)
    save_torch    paged blocks --torch indexing--> device scratch --copy_--> pinned page
    save_dma      a contiguous device tensor --copy_--> pinned page         (the baseline)
    load_*        the reverse (load_kernel: one scatter from the pinned page)

``*_vs_dma`` is the median over rounds of DMA seconds / path seconds: the fraction of a pinned
DMA's rate the path reaches (target: the kernel at 0.9 or more; ``_min`` / ``_max``: the
lowest and highest round). ``scratch_*_bytes`` is the
device memory one save and one load allocate beyond the caches (the torch path's scratch, the
kernel's slot offsets). After timing, every layout is checked bit for bit: the kernel's gather
equals the torch path's, and a scatter from the page reads back exact; the bench fails
otherwise.

Without a GPU (``--device cpu``) the host page is plain memory, the torch path is one copy,
and the kernel runs only under ``TRITON_INTERPRET=1`` (slow: a dry run with small shapes).
The tensors are built as vLLM's allocator views them (no vLLM needed: the strides are a
permutation of one dense allocation; the kernel tests check them against vLLM's own).
"""

from __future__ import annotations

import argparse
import os
import random
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from kvtier.bench.checks import require
from kvtier.bench.timing import alternate, host_load
from kvtier.integrations.vllm.paged import PagedKV

# vLLM 0.32's KVCacheLayout: the physical (memory) order of the logical axes [L, B, H, N, C].
VLLM_ORDERS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
LAYOUTS = (*VLLM_ORDERS, "kv-first", "mla")
MLA_LATENT = 576  # DeepSeek's 512 + 64


def vllm_caches(
    order: tuple[int, ...],
    *,
    layers: int,
    blocks: int,
    heads: int,
    block: int,
    content: int,
    dtype: torch.dtype,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """One ``[blocks, heads, block, content]`` view per layer of a single allocation whose
    memory order is ``order`` (what ``vllm.v1.worker.utils.allocate_kv_cache`` hands a
    connector for that ``KVCacheLayout``; ``content`` is ``2*head_dim`` for K|V, or an MLA
    latent)."""
    logical = (layers, blocks, heads, block, content)
    raw = torch.empty([logical[axis] for axis in order], dtype=dtype, device=device)
    view = raw.permute(*[order.index(axis) for axis in range(5)])
    return {f"layers.{i}.attn": view[i] for i in range(layers)}


def build(
    name: str, args: argparse.Namespace, blocks: int, device: torch.device
) -> tuple[PagedKV, dict[str, torch.Tensor]]:
    """The layout ``name``'s caches (filled with random values) and its :class:`PagedKV`."""
    dtype = torch.bfloat16
    heads, dim = (1, MLA_LATENT) if name == "mla" else (args.kv_heads, args.head_dim)
    if name == "kv-first":
        shape = (2, blocks, args.block, heads, dim)
        kv = {
            f"layers.{i}.attn": torch.empty(shape, dtype=dtype, device=device)
            for i in range(args.layers)
        }
    else:
        order = VLLM_ORDERS.get(name, VLLM_ORDERS["LBHNC"])
        content = dim if name == "mla" else 2 * dim
        kv = vllm_caches(
            order,
            layers=args.layers,
            blocks=blocks,
            heads=heads,
            block=args.block,
            content=content,
            dtype=dtype,
            device=device,
        )
    gen = torch.Generator(device=device).manual_seed(0)
    for tensor in kv.values():
        tensor.copy_(torch.randn(tensor.shape, generator=gen, device=device))
    paged = PagedKV.from_vllm(
        kv, block_size=args.block, num_kv_heads=heads, head_dim=dim, mla=name == "mla"
    )
    return paged, kv


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=32, help="attention layers (8B: 32)")
    parser.add_argument("--kv-heads", type=int, default=8, help="KV heads (8B: 8)")
    parser.add_argument("--head-dim", type=int, default=128, help="head dimension (8B: 128)")
    parser.add_argument("--block", type=int, default=16, help="vLLM block size in tokens")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per save and load")
    parser.add_argument("--repeats", type=int, default=9, help="rounds; medians are reported")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated")
    parser.add_argument(
        "--device", default="cpu", help="where vLLM's KV lives: cpu, or cuda (needs a GPU)"
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench paged: --device cuda: torch sees no GPU")
    cuda = device.type == "cuda"
    kernel_on = cuda or os.environ.get("TRITON_INTERPRET") == "1"
    n = args.tokens
    needed = -(-n // args.block)
    blocks = 2 * needed + 1  # room to scatter the request's blocks; block 0 is vLLM's null
    table = random.Random(0).sample(range(1, blocks), needed)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "tokens": n,
        "shape": f"{args.layers} layers x {args.kv_heads} kv heads x {args.head_dim}, bf16, "
        f"block {args.block}",
        "kernel": "triton" if kernel_on else "none (no GPU; set TRITON_INTERPRET=1 to run it)",
    }

    for name in [x for x in args.layouts.split(",") if x]:
        require(name in LAYOUTS, f"unknown layout {name!r}; use {', '.join(LAYOUTS)}")
        result.update(_measure(name, args, blocks, table, device, kernel_on))
    result.update(host_load())
    return result


def _measure(
    name: str,
    args: argparse.Namespace,
    blocks: int,
    table: list[int],
    device: torch.device,
    kernel_on: bool,
) -> dict[str, Any]:
    """One layout's figures (see the module docstring)."""
    cuda = device.type == "cuda"
    n = args.tokens

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    paged, _ = build(name, args, blocks, device)
    torch_path = replace(paged, kernel=None)
    kernel_path = paged.with_kernel() if kernel_on else None
    shape = paged.layout().kv_shape(n)
    page = torch.empty(shape, dtype=torch.bfloat16, pin_memory=cuda)
    scratch = torch.empty(shape, dtype=torch.bfloat16, device=device)  # torch path's
    twin = torch.randn(shape, device=device).to(torch.bfloat16)  # the DMA's source
    page.copy_(twin.cpu())

    def save_torch() -> None:
        if cuda:
            torch_path.gather(table, 0, n, scratch)
            page.copy_(scratch, non_blocking=True)
        else:
            torch_path.gather(table, 0, n, page)
        sync()

    def load_torch() -> None:
        if cuda:
            scratch.copy_(page, non_blocking=True)
            torch_path.scatter(table, 0, n, scratch)
        else:
            torch_path.scatter(table, 0, n, page)
        sync()

    def save_dma() -> None:
        page.copy_(twin, non_blocking=True)
        sync()

    def load_dma() -> None:
        twin.copy_(page, non_blocking=True)
        sync()

    fns: dict[str, Callable[[], object]] = {
        "save_torch": save_torch,
        "save_dma": save_dma,
        "load_torch": load_torch,
        "load_dma": load_dma,
    }
    if kernel_path is not None:
        kp = kernel_path

        def save_kernel() -> None:
            kp.gather(table, 0, n, page)
            sync()

        def load_kernel() -> None:
            kp.scatter(table, 0, n, page)
            sync()

        fns["save_kernel"], fns["load_kernel"] = save_kernel, load_kernel
    rounds = alternate(fns, args.repeats)
    nbytes = page.numel() * page.element_size()
    result: dict[str, Any] = {
        f"{name}_mib": round(nbytes / 2**20, 1),
        f"{name}_save_dma_gbps": round(rounds.gbps("save_dma", nbytes), 2),
        f"{name}_load_dma_gbps": round(rounds.gbps("load_dma", nbytes), 2),
    }
    for way in ("save", "load"):
        for path in ("kernel", "torch"):
            if f"{way}_{path}" in fns:
                ratio = rounds.ratio(f"{way}_{path}", f"{way}_dma")
                result.update(ratio.fields(f"{name}_{way}_{path}_vs_dma"))
    if kernel_path is not None:
        result.update(_exact_and_scratch(name, kernel_path, torch_path, table, n, page, sync))
    return result


def _exact_and_scratch(
    name: str,
    kernel: PagedKV,
    torch_path: PagedKV,
    table: list[int],
    n: int,
    page: torch.Tensor,
    sync: Callable[[], None],
) -> dict[str, Any]:
    """Bit-exactness of the kernel against the torch path, and the device memory one save
    and one load allocate on each path."""
    device = kernel.layers[0].device
    want = torch.zeros(page.shape, dtype=page.dtype, device=device)
    torch_path.gather(table, 0, n, want)
    page.zero_()
    kernel.gather(table, 0, n, page)
    sync()
    as_int = torch.int16
    require(
        torch.equal(page.view(as_int), want.cpu().view(as_int)),
        f"{name}: the kernel's gather differs from the torch path's",
    )
    page.copy_(torch.randn(page.shape).to(page.dtype))
    kernel.scatter(table, 0, n, page)
    torch_path.gather(table, 0, n, want)
    sync()
    require(
        torch.equal(page.view(as_int), want.cpu().view(as_int)),
        f"{name}: a kernel scatter does not read back exact",
    )
    if device.type != "cuda":
        return {}

    def peak(fn: Callable[[], object]) -> int:
        sync()
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        sync()
        return int(torch.cuda.max_memory_allocated(device) - before)

    def torch_round_trip() -> None:
        scratch = torch.empty(page.shape, dtype=page.dtype, device=device)
        torch_path.gather(table, 0, n, scratch)
        page.copy_(scratch, non_blocking=True)
        scratch.copy_(page, non_blocking=True)
        torch_path.scatter(table, 0, n, scratch)

    def kernel_round_trip() -> None:
        kernel.gather(table, 0, n, page)
        kernel.scatter(table, 0, n, page)

    return {
        f"{name}_scratch_kernel_bytes": peak(kernel_round_trip),
        f"{name}_scratch_torch_bytes": peak(torch_round_trip),
    }
