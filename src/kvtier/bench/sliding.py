"""``kvtier bench sliding [TRACE]``: a sliding-window model's hits per byte, three ways.

What kvtier keeps of a sliding-window model's layers decides how many bytes a token costs
and where a later request can resume (:mod:`kvtier.bench.sliding_sims`): every token
(``every``, kvtier's records when the window's kept tokens are a chunk or more), a large
chunk that keeps only its last ``keep`` sliding tokens (``chunk G``), the same with each
prompt's checkpoint at its last whole block (``chunk G+checkpoints``: kvtier's records with
``chunk_size`` G, its default for a sliding model at G = 4 x keep), or lean records with
whole ones only before anchors (``anchors``: a prompt's end and where a prompt left the
cached prefix). Each is replayed on the trace in one
LRU of the same bytes, at several capacities (fractions of the bytes ``every`` needs to hold
the whole trace), so the figures read as hits per GB.

The model is given by its window, its engine block and its sliding layers' share of the KV
(``--local-global 5:1`` for Gemma-3, ``1:1`` for gpt-oss); ``--token-bytes`` turns the
capacities into GB for a model of that many KV bytes per token (default: Gemma-3-27B in
bf16, 62 layers x 16 KV heads x 128 x K and V x 2 bytes).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from kvtier.bench.sliding_sims import (
    Anchors,
    ColdGroups,
    Every,
    Grid,
    GridCheckpoints,
    Groups,
    Policy,
    SlidingModel,
    replay,
)
from kvtier.bench.trace_file import Trace, add_path_argument, load
from kvtier.errors import InputError
from kvtier.layout import sliding_keep

GEMMA3_27B_TOKEN_BYTES = 62 * 16 * 128 * 2 * 2
CAPACITIES = "0.02,0.05,0.1,0.25,1"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_path_argument(parser)
    parser.add_argument("--block-tokens", type=int, default=512, help="tokens per hash id")
    parser.add_argument("--rechain", action="store_true", help="chain ids that name contents")
    parser.add_argument("--window", type=int, default=1024, help="sliding window in tokens")
    parser.add_argument(
        "--engine-block", type=int, default=16, help="the engine's KV block (vLLM: 16 on GPU)"
    )
    parser.add_argument(
        "--local-global", default="5:1", help="sliding layers : full layers (Gemma-3 5:1)"
    )
    parser.add_argument(
        "--capacity",
        default=CAPACITIES,
        help="comma-separated fractions of the bytes that hold the whole trace every token",
    )
    parser.add_argument(
        "--chunks",
        default=None,
        help="comma-separated chunk sizes of 'chunk G' (default: the trace's block, 2048, 4096)",
    )
    parser.add_argument(
        "--token-bytes",
        type=int,
        default=GEMMA3_27B_TOKEN_BYTES,
        help="KV bytes of one token of every layer, for the GB figures",
    )


def sliding_model(window: int, engine_block: int, local_global: str) -> SlidingModel:
    try:
        local, full = (int(x) for x in local_global.split(":"))
        if local <= 0 or full < 0:
            raise ValueError
    except ValueError:
        raise InputError(
            f"--local-global {local_global!r} is not LOCAL:GLOBAL layer counts "
            "(local above 0, global 0 or more), e.g. 5:1"
        ) from None
    if window <= 0 or engine_block <= 0:
        raise InputError(
            f"--window {window} and --engine-block {engine_block} must both be above 0"
        )
    return SlidingModel(local / (local + full), sliding_keep(window, engine_block))


def _fractions(text: str, name: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(v <= 0 for v in values):
        raise InputError(f"--{name} {text!r}: comma-separated numbers above 0, e.g. 0.05,0.1")
    return values


def _whole_blocks(trace: Trace) -> int:
    """Distinct blocks of the trace that are whole (a prompt's partial last one is not)."""
    seen: set[int] = set()
    for ids, tokens in zip(trace.requests, trace.tokens, strict=True):
        whole = len(tokens) - (tokens[-1] < trace.block_tokens)
        seen.update(ids[:whole])
    return len(seen)


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    model = sliding_model(args.window, args.engine_block, args.local_global)
    trace = load(args.path, block_tokens=args.block_tokens, rechain=args.rechain)
    block = trace.block_tokens
    chunks = [int(c) for c in _fractions(args.chunks or f"{block},2048,4096", "chunks")]
    if any(c % block for c in chunks):
        raise InputError(f"--chunks {args.chunks!r}: each a multiple of --block-tokens {block}")
    # Capacity 1: the bytes of every whole block of the trace, every token kept.
    every_bytes = _whole_blocks(trace) * block
    points: dict[str, dict[str, Any]] = {}
    held: dict[str, dict[str, float]] = {}
    for fraction in _fractions(args.capacity, "capacity"):
        capacity = fraction * every_bytes
        policies: list[Policy] = [
            Every(model, block, capacity),
            Anchors(model, block, capacity),
            Groups(model, block, capacity),
            ColdGroups(model, block, capacity),
        ]
        policies += [Grid(model, block, capacity, c // block) for c in chunks]
        policies += [GridCheckpoints(model, block, capacity, c // block) for c in chunks]
        outcomes = [replay(trace, p) for p in policies]
        points[f"{fraction:g}"] = {
            "gb": capacity * args.token_bytes / 1e9,
            **{o.policy: o.hit_ratio for o in outcomes},
        }
        held[f"{fraction:g}"] = {o.policy: o.held_per_token for o in outcomes}
    stored = {o.policy: o.stored_per_token for o in outcomes}  # the last (largest) capacity
    return {
        "window": args.window,
        "keep": model.keep,
        "sliding_share": model.share,
        "requests": len(trace.requests),
        "every_bytes_gb": every_bytes * args.token_bytes / 1e9,
        "stored_per_token": stored,
        "hit_ratio": points,
        "held_per_token": held,
        "seconds": time.perf_counter() - started,
    }
