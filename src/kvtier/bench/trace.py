"""``kvtier bench trace [PATH]``: kvtier's real CPU tier replaying a production trace (by default
the one shipped with kvtier, Mooncake's conversation trace), against the offline optimum, plain
LRU, ARC and an infinite cache, in the same run.

The replay (``kvtier.bench.trace_sims.replay``): one request at a time in arrival order; a
lookup pins the longest cached prefix (``CpuTier.pin_prefix``, a miss ends it); then every
block of the prompt that is not cached is stored (``CpuTier.allocate`` + ``insert``, which
evicts by the tier's policy and may decline a block), as the engine stores: a prompt's
partial last block only with ``--save-unfull-chunk`` (kvtier's ``save_unfull_chunk``, off by
default). Each block id is a chunk key, each page 8 bytes: the tier's index, policy and page
pool run for real, no payload is copied. Capacities are fractions of the trace's unique
blocks.

Fields:

``cpu_hit_ratio``
    Token hit ratio of the CPU tier with ``--capacity``, policy ``--policy`` (the default
    ``cache_policy``).
``hit_ratio``
    The tiers replayed: the CPU tier alone, or with ``--disk-capacity`` a whole Engine with
    that CPU tier and a disk tier of real files (``kvtier.bench.trace_engine``); then also
    ``hit_of_opt`` (against the optimum at ``--capacity``: what the same RAM gets),
    ``lru_combined_hit_ratio`` (one plain LRU of the CPU and disk capacities together),
    ``disk_bytes_per_hit_token`` (disk bytes written per token served, with this replay's
    8-byte payloads), ``disk_writes_per_hit_chunk`` (chunk files written per chunk served,
    which carries over to real payloads: the SSD's side of the cost) and
    ``engine_seconds``.
``opt_hit_ratio`` / ``lru_hit_ratio`` / ``arc_hit_ratio`` / ``inf_hit_ratio``
    The reference caches (``trace_sims``) at the same capacity, each storing every block as
    the peers do; ``cpu_of_opt`` the ratio.
``lru_whole_hit_ratio``
    Plain LRU that, as kvtier by default, never stores a partial block: what the policy adds
    over kvtier's own storing rule alone.
``curve``
    ``{capacity: {"cpu": .., "opt": .., "lru": .., "arc": .., "lru_whole": ..}}`` at 1-40 %.
``capacity_for_0_9_opt``
    The least capacity (to 1 % of the unique blocks) at which the CPU tier reaches 0.9 of
    the optimum's hit ratio at ``--capacity``: the memory kvtier needs for what the optimum
    gets from ``--capacity`` (null when not reached by 100 %).
``codec`` (with ``--codec NAME``)
    Capacity counted in bytes: ``ram_bytes`` is ``--capacity`` of the unique blocks at the
    model dtype (``--dtype``) of a reference layout (32 layers x 8 KV heads x 128, a
    Llama-3-8B rank: ``block_bytes`` per block of ``--block-tokens``). ``codec_hit_ratio``
    is kvtier's coded CPU tier (what ``cpu_codec`` builds) replayed in those bytes
    (``kvtier.bench.trace_codec``: its staging pages, slots, checksums and codec run for
    real, on a scaled block), ``codec_of_opt`` that against the optimum at the same RAM
    without a codec (the ``cpu_of_opt`` beside it is the same RAM without a codec).
    ``codec_ratio`` is the payload over the stored bytes (exact for fp8 and int8, scales
    included; measured on the synthetic KV of ``kvtier.bench.codec_data`` for a byte
    codec); ``codec_sim_hit_ratio`` the plain CPU tier holding ``ratio`` times the blocks
    (no staging, no slot rounding: the bound the real tier approaches), and
    ``codec_opt_hit_ratio`` the optimum with that many blocks.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

from kvtier.bench import codec as codec_bench
from kvtier.bench import (
    trace_codec,
    trace_engine,
    trace_plot,
    trace_sims,
    trace_synthetic,
    trace_tenants,
)
from kvtier.bench.trace_file import Trace, add_path_argument, load
from kvtier.keys import ChunkKey
from kvtier.layout import KVLayout, dtype_from_name
from kvtier.memory.block_pool import BlockPool
from kvtier.storage import codecs
from kvtier.storage.cpu import CpuTier
from kvtier.storage.cpu_coded import STAGING_SHARE
from kvtier.storage.policy import POLICIES, make_policy

CURVE = (0.01, 0.02, 0.05, 0.10, 0.20, 0.40)
PAGE_BYTES = 8
DEFAULT_POLICY = "REUSE"  # cache_policy's default
REFERENCE = (32, 8, 128)  # layers, KV heads, head dim: the layout --codec counts bytes of


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_path_argument(parser)
    parser.add_argument(
        "--synthetic",
        metavar="NAME",
        choices=list(trace_synthetic.SHAPES),
        help="replay a synthetic trace of this shape instead of PATH (docs/policies.md): "
        + ", ".join(trace_synthetic.SHAPES),
    )
    parser.add_argument(
        "--seed", type=int, default=None, help="with --synthetic: its seed (default: fixed)"
    )
    parser.add_argument("--capacity", type=float, default=0.1, help="fraction of unique blocks")
    parser.add_argument("--block-tokens", type=int, default=512, help="tokens per hash id")
    parser.add_argument("--rechain", action="store_true", help="chain ids that name contents")
    parser.add_argument(
        "--policy", default=DEFAULT_POLICY, choices=sorted(POLICIES), help="cache_policy"
    )
    parser.add_argument(
        "--disk-capacity",
        type=float,
        default=0.0,
        help="also replay a whole Engine with a disk tier of this fraction of unique blocks",
    )
    parser.add_argument(
        "--codec",
        choices=[c.name for c in codecs.registered()],
        help="also replay kvtier's CPU tier through this codec (cpu_codec) in the same bytes",
    )
    parser.add_argument(
        "--codec-staging",
        type=float,
        default=1 / STAGING_SHARE,
        help="with --codec: the share of the RAM kept as staging pages (cpu_codec_staging)",
    )
    parser.add_argument(
        "--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="model dtype"
    )
    parser.add_argument(
        "--save-unfull-chunk",
        action="store_true",
        help="also store each prompt's partial last block (kvtier's save_unfull_chunk)",
    )
    parser.add_argument(
        "--plot", metavar="FILE", help="also draw the hit ratio by capacity as a PNG (matplotlib)"
    )
    trace_tenants.add_arguments(parser)


class CpuReplay:
    """The real CPU tier behind the replay interface (keys: block ids as 16 bytes)."""

    def __init__(self, capacity: int, policy: str, whole_tokens: int) -> None:
        """``whole_tokens``: blocks of fewer tokens are not stored (0: every block is)."""
        self.pool = BlockPool(max(capacity, 1), PAGE_BYTES)
        self.tier = CpuTier(self.pool, lambda _: PAGE_BYTES, make_policy(policy))
        self.whole_tokens = whole_tokens
        self.keys: dict[int, ChunkKey] = {}

    def _keys(self, ids: Sequence[int]) -> list[ChunkKey]:
        keys = self.keys
        return [keys.get(b) or keys.setdefault(b, b.to_bytes(16, "little")) for b in ids]

    def lookup(self, ids: Sequence[int]) -> int:
        pages = self.tier.pin_prefix(self._keys(ids))
        self.pool.release(pages)
        return len(pages)

    def store(self, ids: Sequence[int], start: int, tokens: Sequence[int]) -> None:
        """As the engine stores (``StorageManager.reserve`` + ``commit``): a page for each
        chunk not cached, one at a time, then each inserted (the policy may decline it: its
        page goes back)."""
        tier, whole = self.tier, self.whole_tokens
        keys = self._keys(ids[start:])
        missing = [
            (key, n)
            for key, n, present in zip(keys, tokens[start:], tier.contains(keys), strict=True)
            if not present and n >= whole
        ]
        pages: list[int] = []
        for _ in missing:  # a page at a time, as StorageManager.reserve takes them
            got = tier.allocate(1)
            if got is None:  # nothing is pinned in a replay: a pool smaller than a prompt
                break
            pages += got
        for (key, n), page in zip(missing, pages, strict=False):
            if not tier.insert(key, page, n):
                self.pool.release([page])

    def close(self) -> None:
        self.tier.close()
        self.pool.close()


def cpu_ratio(trace: Trace, capacity: int, policy: str, save_unfull: bool = False) -> float:
    cache = CpuReplay(capacity, policy, 0 if save_unfull else trace.block_tokens)
    try:
        return trace_sims.replay(trace, cache)
    finally:
        cache.close()


def point(
    trace: Trace, unique: int, fraction: float, policy: str, save_unfull: bool
) -> dict[str, float]:
    c = max(1, int(fraction * unique))
    return {
        "cpu": cpu_ratio(trace, c, policy, save_unfull),
        "opt": trace_sims.replay(trace, trace_sims.Optimum(c, trace)),
        "lru": trace_sims.replay(trace, trace_sims.Lru(c)),
        "arc": trace_sims.replay(trace, trace_sims.Arc(c)),
        "lru_whole": trace_sims.replay(trace, trace_sims.Lru(c, trace.block_tokens)),
    }


def capacity_for(
    trace: Trace,
    unique: int,
    target: float,
    policy: str,
    save_unfull: bool,
    curve: dict[float, float],
) -> float | None:
    """Least fraction (to 0.01) at which the CPU tier's hit ratio reaches ``target``,
    bisected between the ``curve`` points (fraction -> CPU hit ratio) that bracket it."""
    lo = max((f for f, r in curve.items() if r < target), default=0.0)
    hi = min((f for f, r in curve.items() if r >= target and f > lo), default=1.0)
    if hi == 1.0 and cpu_ratio(trace, unique, policy, save_unfull) < target:
        return None
    while hi - lo > 0.01:
        mid = (lo + hi) / 2
        if cpu_ratio(trace, max(1, int(mid * unique)), policy, save_unfull) >= target:
            hi = mid
        else:
            lo = mid
    return round(hi, 4)


def load_trace(args: argparse.Namespace) -> Trace:
    """The trace ``args`` name: ``--synthetic NAME`` (its 512-token blocks), else PATH."""
    if args.synthetic:
        return trace_synthetic.generate(args.synthetic, args.seed)
    return load(args.path, block_tokens=args.block_tokens, rechain=args.rechain)


def progress(started: float, what: str) -> None:
    """One line on stderr per step of a replay that takes a minute or two: the result is
    printed at the end (stdout stays the result alone, for --json)."""
    print(f"bench trace: {what} ({time.perf_counter() - started:.0f} s)", file=sys.stderr)


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    trace = load_trace(args)
    unique = trace.unique_blocks()
    unfull = args.save_unfull_chunk
    steps = len(CURVE) + (args.capacity not in CURVE)
    progress(started, f"{len(trace.requests)} requests, {unique} unique blocks; {steps} capacities")
    main = point(trace, unique, args.capacity, args.policy, unfull)
    progress(started, f"capacity {args.capacity:g}: cpu {main['cpu']:.3f}, opt {main['opt']:.3f}")
    points: dict[float, dict[str, float]] = {}
    for f in CURVE:
        points[f] = main if f == args.capacity else point(trace, unique, f, args.policy, unfull)
        if f != args.capacity:
            progress(started, f"capacity {f:g}: cpu {points[f]['cpu']:.3f}")
    inf = trace_sims.replay(trace, trace_sims.Infinite())
    cpu_curve = {f: p["cpu"] for f, p in points.items()} | {args.capacity: main["cpu"]}
    progress(started, "the capacity for 0.9 of the optimum")
    need = capacity_for(trace, unique, 0.9 * main["opt"], args.policy, unfull, cpu_curve)
    tiers = _with_disk(trace, unique, args, main["opt"]) if args.disk_capacity > 0 else {}
    coded = _with_codec(trace, unique, args, main["opt"]) if args.codec else {}
    tenants = trace_tenants.section(trace, args) if args.tenants else {}
    result = {
        "trace": args.synthetic or args.path,
        "policy": args.policy,
        "save_unfull_chunk": unfull,
        "capacity": args.capacity,
        "capacity_blocks": max(1, int(args.capacity * unique)),
        "requests": len(trace.requests),
        "unique_blocks": unique,
        "cpu_hit_ratio": main["cpu"],
        "hit_ratio": main["cpu"],
        **tiers,
        "opt_hit_ratio": main["opt"],
        "lru_hit_ratio": main["lru"],
        "arc_hit_ratio": main["arc"],
        "lru_whole_hit_ratio": main["lru_whole"],
        "inf_hit_ratio": inf,
        "cpu_of_opt": main["cpu"] / main["opt"] if main["opt"] else 0.0,
        "capacity_for_0_9_opt": need,
        **coded,
        **tenants,
        "curve": {f"{f:g}": p for f, p in points.items()},
        "seconds": time.perf_counter() - started,
    }
    if args.plot:
        trace_plot.write_plot(result, args.plot)
        result["plot"] = args.plot
    return result


def _with_disk(
    trace: Trace, unique: int, args: argparse.Namespace, opt: float
) -> dict[str, float | int]:
    if not trace_engine.ids_fit(trace.requests):
        raise SystemExit("--disk-capacity: block ids must fit int32 token ids (use --rechain)")
    cpu, disk = max(1, int(args.capacity * unique)), max(1, int(args.disk_capacity * unique))
    started = time.perf_counter()
    result = trace_engine.replay(trace, cpu, disk, args.policy, save_unfull=args.save_unfull_chunk)
    return {
        "disk_capacity": args.disk_capacity,
        "hit_ratio": result.hit_ratio,
        "hit_of_opt": result.hit_ratio / opt if opt else 0.0,
        "engine_cpu_hit_ratio": result.cpu_hit_ratio,
        "lru_combined_hit_ratio": trace_sims.replay(trace, trace_sims.Lru(cpu + disk)),
        "disk_bytes_written": result.disk_bytes_written,
        "disk_files_written": result.disk_files_written,
        "disk_bytes_per_hit_token": (
            result.disk_bytes_written / result.hit_tokens if result.hit_tokens else 0.0
        ),
        "disk_writes_per_hit_chunk": (
            result.disk_files_written / result.hit_blocks if result.hit_blocks else 0.0
        ),
        "engine_seconds": time.perf_counter() - started,
    }


def _with_codec(
    trace: Trace, unique: int, args: argparse.Namespace, opt: float
) -> dict[str, float | int | str]:
    """The CPU tier at the same RAM with blocks stored by ``args.codec`` (module docstring)."""
    codec = codecs.codec_from_config("--codec", args.codec)
    layout = KVLayout(*REFERENCE, dtype_from_name(args.dtype))
    if isinstance(codec, codecs.QuantizedCodec):
        ratio = codec_bench.capacity_ratio(codec, layout, args.block_tokens)
    else:  # a byte codec's ratio does not depend on the layer count: measure 4 layers
        small = KVLayout(4, *REFERENCE[1:], layout.dtype)
        ratio = codec_bench.capacity_ratio(codec, small, args.block_tokens)
    blocks = max(1, int(args.capacity * unique))
    block_bytes = layout.payload_bytes(args.block_tokens)
    fit = max(1, int(blocks * block_bytes / (block_bytes / ratio)))
    started = time.perf_counter()
    real = trace_codec.coded_hit_ratio(
        trace,
        codec,
        layout,
        blocks * block_bytes,
        args.policy,
        args.save_unfull_chunk,
        args.codec_staging,
    )
    hit = float(real["codec_hit_ratio"])
    return {
        "codec": codec.name,
        "dtype": args.dtype,
        "block_bytes": block_bytes,
        "ram_bytes": blocks * block_bytes,
        "codec_ratio": ratio,
        **real,
        "codec_of_opt": hit / opt if opt else 0.0,
        "codec_seconds": time.perf_counter() - started,
        "codec_capacity_blocks": fit,
        "codec_sim_hit_ratio": cpu_ratio(trace, fit, args.policy, args.save_unfull_chunk),
        "codec_opt_hit_ratio": trace_sims.replay(trace, trace_sims.Optimum(fit, trace)),
    }
