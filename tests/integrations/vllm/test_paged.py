"""PagedKV: vLLM's paged layouts <-> kvtier chunk layout, on plain tensors."""

from __future__ import annotations

import random

import pytest
import torch

from kvtier.errors import InputError
from kvtier.integrations.vllm.paged import PagedKV

LAYERS, HEADS, DIM, BLOCK, BLOCKS = 3, 2, 8, 16, 12


def caches(kv_first: bool, tensor_block: int = BLOCK) -> dict[str, torch.Tensor]:
    blocks = BLOCKS * BLOCK // tensor_block
    shape = (
        (2, blocks, tensor_block, HEADS, DIM)
        if kv_first
        else (blocks, HEADS, tensor_block, 2 * DIM)
    )
    gen = torch.Generator().manual_seed(int(kv_first))
    return {f"layers.{i}.attn": torch.randn(shape, generator=gen) for i in range(LAYERS)}


def paged(kv: dict[str, torch.Tensor]) -> PagedKV:
    return PagedKV.from_vllm(kv, block_size=BLOCK, num_kv_heads=HEADS, head_dim=DIM)


def expected_token(kv: dict[str, torch.Tensor], kv_first: bool, slot: int, tb: int) -> torch.Tensor:
    """[2, layers, heads*dim] of one slot, read the slow obvious way."""
    rows = []
    for layer in kv.values():
        if kv_first:
            k, v = layer[0, slot // tb, slot % tb], layer[1, slot // tb, slot % tb]
        else:
            both = layer[slot // tb, :, slot % tb]  # [heads, 2*dim]
            k, v = both[:, :DIM], both[:, DIM:]
        rows.append(torch.stack([k.reshape(-1), v.reshape(-1)]))
    return torch.stack(rows, dim=1)


@pytest.mark.parametrize("kv_first", [False, True])
@pytest.mark.parametrize("tensor_block", [BLOCK, BLOCK // 2])
def test_gather_reads_each_token_from_its_block(kv_first: bool, tensor_block: int) -> None:
    kv = caches(kv_first, tensor_block)
    pkv = paged(kv)
    assert pkv.kv_first is kv_first and pkv.tensor_block == tensor_block
    table = random.Random(3).sample(range(BLOCKS), 5)  # a request's scattered blocks
    out = torch.zeros(2, LAYERS, 80, HEADS * DIM)
    pkv.gather(table, 5, 70, out)
    for p in (5, 15, 16, 40, 69):
        slot = table[p // BLOCK] * BLOCK + p % BLOCK
        assert torch.equal(out[:, :, p], expected_token(kv, kv_first, slot, tensor_block))
    assert not out[:, :, :5].any() and not out[:, :, 70:].any()


@pytest.mark.parametrize("kv_first", [False, True])
def test_scatter_then_gather_is_exact_and_touches_only_its_blocks(kv_first: bool) -> None:
    kv = caches(kv_first)
    before = {k: v.clone() for k, v in kv.items()}
    pkv = paged(kv)
    table = [7, 2, 9]
    src = torch.randn(2, LAYERS, 48, HEADS * DIM)
    pkv.scatter(table, 16, 48, src)  # blocks 2 and 9 only
    back = torch.zeros_like(src)
    pkv.gather(table, 16, 48, back)
    assert torch.equal(back[:, :, 16:48], src[:, :, 16:48])
    for name, tensor in kv.items():
        untouched = [b for b in range(BLOCKS) if b not in (2, 9)]
        index = (slice(None), untouched) if kv_first else (untouched,)
        assert torch.equal(tensor[index], before[name][index])
    assert pkv.layout().num_layers == LAYERS and pkv.layout().hidden == HEADS * DIM


def test_unknown_layouts_and_short_tables_are_refused() -> None:
    with pytest.raises(InputError, match=r"shape \(4, 2, 16, 7\)"):
        paged({"l0": torch.zeros(4, 2, 16, 7)})
    with pytest.raises(InputError, match="one layout for all layers"):
        paged({"l0": torch.zeros(4, 2, 16, 16), "l1": torch.zeros(5, 2, 16, 16)})
    with pytest.raises(InputError, match="no KV tensors"):
        paged({})
    pkv = paged(caches(False))
    with pytest.raises(InputError, match="not covered by 2 blocks"):
        pkv.gather([0, 1], 0, 33, torch.zeros(2, LAYERS, 40, HEADS * DIM))
