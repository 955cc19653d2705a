"""Group-structured layouts for the engine, server and PD tests (chunks of 16 tokens)."""

from __future__ import annotations

import torch

from kvtier.layout import GroupKind, KVGroup, KVLayout

CHUNK = 16
# Gemma-3-like: a sliding-window group (window 4) that keeps the last 6 tokens of a chunk,
# and a full group, interleaved.
GEMMA = KVLayout(
    4,
    2,
    8,
    torch.float32,
    groups=(KVGroup(GroupKind.SLIDING, (0, 2), 4, keep=6), KVGroup(GroupKind.FULL, (1, 3))),
)
SLIDING = "sliding/w4/k6:0,2"
# DeepSeek-like MLA: one 24-wide latent per token and layer.
MLA = KVLayout(3, 1, 24, torch.float32, planes=1)
# Qwen3-Next-like: a full group and a state group whose packed state (the state at each
# chunk's end) fills the last layer of the chunk tensor.
HYBRID = KVLayout(
    3,
    2,
    8,
    torch.float32,
    groups=(KVGroup(GroupKind.FULL, (0, 1)), KVGroup(GroupKind.STATE, (2,), detail="GDN.2x96")),
)
# A trimmed sliding group, a full group and a state group in one page of groups.
SLIDING_STATE = KVLayout(
    4,
    2,
    8,
    torch.float32,
    groups=(
        KVGroup(GroupKind.SLIDING, (0,), 4, keep=6),
        KVGroup(GroupKind.FULL, (1, 2)),
        KVGroup(GroupKind.STATE, (3,), detail="MAMBA2.1x200"),
    ),
)
LAYOUTS = [GEMMA, MLA, HYBRID, SLIDING_STATE]
LAYOUT_IDS = ["gemma-like", "mla", "hybrid-state", "sliding-and-state"]


def kept(kv: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """What a load of ``kv`` gives back: every group's kept tokens, zeros elsewhere."""
    out = kv.clone()
    for group in layout.groups:
        if not group.keep:
            continue
        for start in range(0, kv.shape[2], CHUNK):
            end = min(start + CHUNK, kv.shape[2])
            out[:, list(group.layers), start : end - group.kept(end - start)] = 0
    return out
