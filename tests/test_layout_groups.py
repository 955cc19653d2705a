"""A layout is a list of KV-cache groups: kinds, windows and layers enter the fingerprint;
MLA's latent (planes 1) is the same on every tensor-parallel rank."""

from __future__ import annotations

import pytest
import torch

from kvtier.errors import InputError
from kvtier.fingerprint import Fingerprint
from kvtier.layout import GroupKind, KVGroup, KVLayout, parse_groups, state_layers_needed

LLAMA = KVLayout(4, 2, 64, torch.float32)
GEMMA = KVLayout(
    4,
    2,
    64,
    torch.float32,
    groups=(KVGroup(GroupKind.SLIDING, (0, 2), 128), KVGroup(GroupKind.FULL, (1, 3))),
)
MLA = KVLayout(4, 1, 576, torch.float32, planes=1)
TRIMMED = KVLayout(
    4,
    2,
    64,
    torch.float32,
    groups=(KVGroup(GroupKind.SLIDING, (0, 2), 128, keep=144), KVGroup(GroupKind.FULL, (1, 3))),
)


def fp(layout: KVLayout, rank: int = 0, world: int = 1) -> str:
    return Fingerprint("m", layout, 256, tp_rank=rank, tp_world_size=world).hex()


def test_a_one_group_layout_keeps_the_fingerprint_it_always_had() -> None:
    """Caches written before groups existed must still match (the old canonical string)."""
    old = "\x1f".join(
        ["kvtier-fp-1", "m", "4x2x64", "float32", "256", "xxh3_128", "tp0/1", ""]
    ).encode()
    assert Fingerprint("m", LLAMA, 256).canonical() == old
    assert LLAMA.describe_groups() == "full:0,1,2,3"


def test_groups_windows_and_planes_enter_the_fingerprint() -> None:
    other_window = KVLayout(
        4,
        2,
        64,
        torch.float32,
        groups=(KVGroup(GroupKind.SLIDING, (0, 2), 256), KVGroup(GroupKind.FULL, (1, 3))),
    )
    assert len({fp(LLAMA), fp(GEMMA), fp(other_window)}) == 3
    assert fp(MLA) != fp(KVLayout(4, 1, 576, torch.float32))


def test_mla_is_stored_once_for_every_tensor_parallel_rank() -> None:
    assert fp(MLA, 0, 2) == fp(MLA, 1, 2) == fp(MLA, 0, 1)
    assert fp(LLAMA, 0, 2) != fp(LLAMA, 1, 2)  # K/V heads are split across ranks


def test_bytes_per_token_per_group_kind() -> None:
    assert MLA.token_bytes() == 4 * 576 * 4 and MLA.kv_shape(3) == (1, 4, 3, 576)
    assert GEMMA.group_token_bytes() == {"sliding": 2 * 2 * 128 * 4, "full": 2 * 2 * 128 * 4}
    assert LLAMA.token_bytes() == 2 * 4 * 128 * 4


def test_describe_and_parse_round_trip() -> None:
    for layout in (LLAMA, GEMMA, MLA, TRIMMED):
        assert parse_groups(layout.describe_groups()) == layout.groups
    assert TRIMMED.describe_groups() == "sliding/w128/k144:0,2;full:1,3"
    assert fp(TRIMMED) != fp(GEMMA)  # another page format, another key
    assert "sliding/w128:0,2" in GEMMA.describe()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"groups": (KVGroup(GroupKind.FULL, (0, 1)),)}, "every layer"),
        ({"planes": 3}, "planes"),
        ({"planes": 1, "groups": (KVGroup(GroupKind.FULL, (0, 1, 2, 3)),)}, "planes"),
    ],
)
def test_bad_groups_name_what_is_wrong(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(InputError, match=match):
        KVLayout(4, 2, 64, torch.float32, **kwargs)  # type: ignore[arg-type]


def test_bad_group_kind_and_window() -> None:
    with pytest.raises(InputError, match="unknown"):
        KVGroup("ring", (0,))  # type: ignore[arg-type]
    with pytest.raises(InputError, match="window"):
        KVGroup(GroupKind.SLIDING, (0,))
    with pytest.raises(InputError, match="layers"):
        parse_groups("full:a,b")


def test_a_state_group_packs_into_the_last_layers_and_enters_the_fingerprint() -> None:
    hybrid = KVLayout(
        2,
        2,
        64,
        torch.bfloat16,
        groups=(KVGroup("full", (0,)), KVGroup(GroupKind.STATE, (1,), detail="GDN_ATTN.3x35840")),
    )
    assert hybrid.unsupported() == [] and hybrid.has_state
    assert hybrid.group_token_bytes() == {"full": 512, "state": 512}
    assert hybrid.payload_bytes(256) == hybrid.token_bytes() * 256
    assert parse_groups(hybrid.describe_groups()) == hybrid.groups
    assert fp(hybrid) != fp(KVLayout(2, 2, 64, torch.bfloat16))
    other = KVLayout(
        2,
        2,
        64,
        torch.bfloat16,
        groups=(KVGroup("full", (0,)), KVGroup(GroupKind.STATE, (1,), detail="MAMBA2.3x35840")),
    )
    assert fp(hybrid) != fp(other)
    with pytest.raises(InputError, match="state layers last"):
        KVLayout(2, 2, 64, torch.bfloat16, groups=(KVGroup("state", (0,)), KVGroup("full", (1,))))
    assert state_layers_needed(3 * 35840, 2 * 256 * 128 * 2) == 1


def test_a_trimmed_sliding_group_stores_only_the_last_keep_tokens_of_a_chunk() -> None:
    """sliding/w128/k144 on 2 of 4 layers, chunk 256: the sliding part holds 144 of 256
    tokens; a chunk shorter than keep keeps all its tokens."""
    per_layer = 2 * 2 * 64 * 4  # K and V, 2 heads x 64, fp32
    assert TRIMMED.chunk_bytes(256) == per_layer * (2 * 144 + 2 * 256)
    assert TRIMMED.payload_bytes(100) == per_layer * 4 * 100
    assert GEMMA.chunk_bytes(256) == GEMMA.token_bytes() * 256 == per_layer * 4 * 256
    assert TRIMMED.group_token_bytes(256) == {"sliding": per_layer * 2 * 144 / 256, "full": 2048}
    gen = torch.Generator().manual_seed(3)
    for n in (256, 100):
        kv = torch.randn(TRIMMED.kv_shape(n), generator=gen)
        page = torch.empty(TRIMMED.payload_bytes(n), dtype=torch.uint8)
        TRIMMED.pack(kv, page)
        out = torch.full_like(kv, 5.0)
        TRIMMED.unpack(page, out)
        kept = n - min(n, 144)
        assert torch.equal(out[:, [1, 3]], kv[:, [1, 3]])
        assert torch.equal(out[:, [0, 2], kept:], kv[:, [0, 2], kept:])
        assert bool((out[:, [0, 2], :kept] == 0).all())  # zeros, never stale bytes


def test_keep_is_for_sliding_groups_and_at_least_the_window() -> None:
    with pytest.raises(InputError, match="keep"):
        KVGroup(GroupKind.SLIDING, (0,), 128, keep=100)
    with pytest.raises(InputError, match="keep"):
        KVGroup(GroupKind.FULL, (0,), keep=100)
