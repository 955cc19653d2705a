"""``kvtier bench codec``: each payload codec's ratio, and its encode and decode speed on one
thread against a memcpy of the same bytes in the same run, on bf16 and fp32 KV.

The KV is :func:`kvtier.bench.codec_data.synthetic_kv` (keys with outlier channels and RoPE,
near-Gaussian values) of an 8-layer, 8-KV-head, 128-head-dim layout, one 256-token chunk
(8 MiB in bf16). Each codec runs through its ``encode`` / ``decode`` (what the record format
calls), torch limited to one thread; each figure is the best of ``--repeat`` runs.

Fields, per dtype (``bf16``, ``fp32``):

``memcpy_gbps``
    One-thread copy of the chunk's bytes into another buffer: the ceiling.
``codecs.<name>``
    ``ratio`` (payload bytes / stored bytes), ``encode_gbps`` and ``decode_gbps`` (payload
    bytes per second; identity's encode is a view, null), ``encode_of_memcpy`` /
    ``decode_of_memcpy``, and for a lossy codec ``key_rel_error`` / ``value_rel_error``
    (relative L2 error of the decoded K and V).
    ``gate``: for a lossy codec, the quality gate's figures at that dtype
    (:func:`kvtier.quality.gate_figures`: recall accuracy with recomputed and with decoded
    KV, next-token KL, greedy agreement, ``passed``); null for a lossless codec (bit-exact:
    nothing to gate) or with ``--no-gate``. The gate's model is trained once per machine
    (about 2 minutes on one core), then loaded from its cache file.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

from kvtier import quality
from kvtier.bench import codec_table
from kvtier.bench.checks import require
from kvtier.bench.codec_data import synthetic_kv
from kvtier.layout import KVLayout
from kvtier.storage import codecs
from kvtier.storage.codecs import PayloadCodec

TOKENS = 256
# The text output (`kvtier bench codec` without --json): the table docs/codecs.md shows.
format_text = codec_table.format_text
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

# The quality gate's figures of a lossy codec at a KV dtype (a test may swap it).
GATE: Callable[[PayloadCodec, torch.dtype], dict[str, Any]] = quality.gate_figures


def bench_layout(dtype: torch.dtype) -> KVLayout:
    return KVLayout(8, 8, 128, dtype)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeat", type=int, default=5, help="runs per figure (best kept)")
    parser.add_argument(
        "--codec", action="append", help="codecs to measure (default: every registered one)"
    )
    parser.add_argument(
        "--no-gate",
        dest="gate",
        action="store_false",
        help="skip the quality gate (its model trains for about 2 minutes on first use)",
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    names = args.codec or [c.name for c in codecs.registered()]
    chosen = [codecs.codec_from_config("--codec", name) for name in names]
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out: dict[str, Any] = {"threads": 1, "tokens": TOKENS}
        for label, dtype in DTYPES.items():
            out[label] = measure_dtype(bench_layout(dtype), chosen, args.repeat, args.gate)
        return out
    finally:
        torch.set_num_threads(before)


def measure_dtype(
    layout: KVLayout, chosen: list[PayloadCodec], repeat: int, gate: bool = False
) -> dict[str, Any]:
    kv = synthetic_kv(layout, TOKENS)
    page = kv.reshape(-1).view(torch.uint8)
    nbytes = page.numel()
    copy = torch.empty_like(page)
    memcpy = nbytes / _best(lambda: copy.copy_(page), repeat) / 1e9
    rows = {c.name: measure_codec(c, layout, kv, memcpy, repeat) for c in chosen}
    for codec in chosen:
        if gate and not codec.lossless:
            rows[codec.name]["gate"] = GATE(codec, layout.dtype)
    return {"layout": layout.describe(), "bytes": nbytes, "memcpy_gbps": memcpy, "codecs": rows}


def measure_codec(
    codec: PayloadCodec, layout: KVLayout, kv: torch.Tensor, memcpy: float, repeat: int
) -> dict[str, Any]:
    page = kv.reshape(-1).view(torch.uint8)
    view = memoryview(page.numpy())  # type: ignore[arg-type]
    nbytes = page.numel()
    stored = memoryview(codec.encode(view, layout)).cast("B")
    out = torch.empty_like(page)
    target = memoryview(out.numpy())  # type: ignore[arg-type]
    # Identity's encode is a view of the page (no byte moves): no speed to report.
    encode = (
        None
        if codec.is_identity
        else nbytes / _best(lambda: codec.encode(view, layout), repeat) / 1e9
    )
    decode = nbytes / _best(lambda: codec.decode(stored, target, layout), repeat) / 1e9
    row: dict[str, Any] = {
        "lossless": codec.lossless,
        "ratio": nbytes / stored.nbytes,
        "encode_gbps": encode,
        "decode_gbps": decode,
        "encode_of_memcpy": None if encode is None else encode / memcpy,
        "decode_of_memcpy": decode / memcpy,
    }
    if codec.lossless:
        require(torch.equal(out, page), f"{codec.name} did not round trip")
    else:
        back = out.view(layout.dtype).view(kv.shape).float()
        for plane, label in enumerate(("key", "value")[: layout.planes]):
            want = kv[plane].float()
            row[f"{label}_rel_error"] = float((back[plane] - want).norm() / want.norm())
    row["gate"] = None  # filled by measure_dtype for a lossy codec
    return row


def capacity_ratio(codec: PayloadCodec, layout: KVLayout, tokens: int) -> float:
    """How many more chunks of ``tokens`` fit in the same bytes with ``codec``: the exact
    stored size for a quantised codec (scales included), the ratio measured on the
    synthetic KV for a byte codec."""
    payload = layout.payload_bytes(tokens)
    if isinstance(codec, codecs.QuantizedCodec):
        return payload / codec.stored_bytes(layout, tokens)
    page = synthetic_kv(layout, tokens).reshape(-1).view(torch.uint8)
    stored = memoryview(codec.encode(memoryview(page.numpy()), layout))  # type: ignore[arg-type]
    return payload / stored.nbytes


def _best(call: Callable[[], object], repeat: int) -> float:
    call()  # warm
    best = float("inf")
    for _ in range(max(1, repeat)):
        started = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - started)
    return best
