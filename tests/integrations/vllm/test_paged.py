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


# -- MLA latents and KV-cache groups ----------------------------------------------------------
LATENT = 576


def test_mla_latent_round_trips_and_names_its_layout() -> None:
    """vLLM's MLA tensor [blocks, 1, block, 576] is one latent per token: planes 1."""
    gen = torch.Generator().manual_seed(3)
    kv = {f"l{i}": torch.randn(BLOCKS, 1, BLOCK, LATENT, generator=gen) for i in range(LAYERS)}
    p = PagedKV.from_vllm(kv, block_size=BLOCK, num_kv_heads=1, head_dim=LATENT, mla=True)
    layout = p.layout()
    assert (layout.planes, layout.hidden, layout.tp_shared) == (1, LATENT, True)
    assert layout.describe_groups() == "mla:0,1,2"
    table = [5, 2, 9]
    out = torch.zeros(layout.kv_shape(40))
    p.gather(table, 0, 40, out)
    slot = table[35 // BLOCK] * BLOCK + 35 % BLOCK
    assert torch.equal(out[0, 1, 35], kv["l1"][slot // BLOCK, 0, slot % BLOCK])
    fresh = {n: torch.zeros_like(t) for n, t in kv.items()}
    q = PagedKV.from_vllm(fresh, block_size=BLOCK, num_kv_heads=1, head_dim=LATENT, mla=True)
    q.scatter(table, 0, 40, out)
    back = torch.zeros_like(out)
    q.gather(table, 0, 40, back)
    assert torch.equal(back, out)


def test_mla_tensor_without_mla_flag_is_a_clear_error() -> None:
    kv = {"l0": torch.zeros(BLOCKS, 1, BLOCK, LATENT)}
    with pytest.raises(InputError, match=r"MLA|blocks"):
        PagedKV.from_vllm(kv, block_size=BLOCK, num_kv_heads=1, head_dim=LATENT)


def test_groups_read_their_own_block_table_and_skip_the_null_block() -> None:
    """Two groups (sliding window on layers 0 and 2, full on 1): each layer addresses its
    group's table; the sliding group's null blocks are never written and make a range
    incomplete."""
    from kvtier.layout import GroupKind

    kv = caches(kv_first=False)
    names = list(kv)
    groups = [
        (GroupKind.SLIDING, 16, [names[0], names[2]]),
        (GroupKind.FULL, 0, [names[1]]),
    ]
    p = PagedKV.from_vllm(kv, block_size=BLOCK, num_kv_heads=HEADS, head_dim=DIM, groups=groups)
    assert p.layer_groups == (0, 1, 0)
    assert p.layout().describe_groups() == "sliding/w16/k32:0,2;full:1"
    tables = ([0, 7, 3], [4, 8, 1])  # the sliding group dropped its first block
    assert not p.complete(tables, 0, 48) and p.complete(tables, 16, 48)
    out = torch.zeros(p.layout().kv_shape(48))
    p.gather(([6, 7, 3], [4, 8, 1]), 0, 48, out)
    assert torch.equal(out[:, 1, 5], expected_token(kv, False, 4 * BLOCK + 5, BLOCK)[:, 1])
    assert torch.equal(out[:, 0, 5], expected_token(kv, False, 6 * BLOCK + 5, BLOCK)[:, 0])
    null_before = kv[names[0]][0].clone()
    p.scatter(tables, 0, 48, torch.ones_like(out))
    assert torch.equal(kv[names[0]][0], null_before)  # the null block is untouched
    assert bool((kv[names[0]][7] == 1).all()) and bool((kv[names[1]][4] == 1).all())


def test_a_trimmed_sliding_group_needs_blocks_only_where_it_keeps_tokens() -> None:
    """Window 16, block 16: the sliding group keeps the last 32 tokens of each chunk (what
    vLLM holds for a resume at the chunk's end or one block before). A save needs real
    blocks only there; a load is restorable only if vLLM has the null block wherever the
    group kept nothing."""
    from kvtier.layout import GroupKind, sliding_keep

    assert sliding_keep(16, 16) == 32 and sliding_keep(128, 16) == 144
    assert sliding_keep(4096, 16) == 4096 + 16
    kv = caches(kv_first=False)
    names = list(kv)
    groups = [(GroupKind.SLIDING, 16, [names[0], names[2]]), (GroupKind.FULL, 0, [names[1]])]
    p = PagedKV.from_vllm(kv, block_size=BLOCK, num_kv_heads=HEADS, head_dim=DIM, groups=groups)
    chunk = 3 * BLOCK
    dropped = ([0, 7, 3], [4, 8, 1])  # the sliding group's first block is the null block
    assert not p.complete(dropped, 0, chunk)  # untrimmed reading: every token
    assert p.complete(dropped, 0, chunk, chunk)  # trimmed: tokens 16..47 only
    assert not p.complete(([0, 0, 3], [4, 8, 1]), 0, chunk, chunk)
    assert p.restorable(dropped, 0, chunk, chunk, chunk)
    assert not p.restorable(([6, 7, 3], [4, 8, 1]), 0, chunk, chunk, chunk)
    # A store and a load through the page format: the kept tokens come back exactly.
    layout = p.layout()
    out = torch.zeros(layout.kv_shape(chunk))
    p.gather(dropped, 16, chunk, out)
    page = torch.empty(layout.payload_bytes(chunk), dtype=torch.uint8)
    assert page.numel() == (2 * 2 * 32 + 2 * 1 * 48) * HEADS * DIM * 4
    layout.pack(out, page)
    back = torch.full_like(out, 9.0)
    layout.unpack(page, back)
    assert torch.equal(back[:, 1], out[:, 1]) and torch.equal(back[:, 0, 16:], out[:, 0, 16:])
    assert bool((back[:, 0, :16] == 0).all())
