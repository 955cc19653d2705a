"""``kvtier bench scale``: how kvtier's costs grow with the work.

Each curve comes with a baseline measured in the same run, so a loaded machine shifts both:

``lookup_ms_<n>_tokens``
    ``Engine.lookup`` of a fully cached ``n``-token prompt (CPU tier, 256-token chunks, a
    small layout: lookup cost does not depend on chunk bytes), median of repeats: hashing,
    index probes and pins. Baseline ``hash_ms_<n>_tokens``: the key chain alone.
``disk_open_s_<n>`` / ``disk_scan_open_s_<n>``
    A restart of the disk tier over ``n`` chunk files until its first hit is served
    (``DiskTier.open`` + one ``get_into``): with the index saved by the previous clean close
    (what a restart does) and with none (every header read, as after a crash before any
    clean close). Chunks are tiny (1 token of a 1-layer, 1-head, head_dim-2 layout: 4096-byte
    header + 8-byte payload, two 4 KiB blocks each) so that a million files are written in
    minutes; open cost is per file, not per byte. Files are written straight to the
    directory (no fsync: they are test data), by two processes, and the page cache is warm
    (a cold cache makes the header scan slower still; the saved index reads one file). With
    a saved index the open serves from it at once and checks it against the directory in the
    background: ``disk_checked_s_<n>`` is the time from the open until that check ended.
``rss_bytes_per_chunk``
    Resident memory the CPU tier adds per cached chunk beyond the chunk's payload bytes
    (index, keys, allocator bookkeeping), measured in a fresh process storing ``--rss-chunks``
    chunks in batches.
``cpu_retrieve_gbps_t<k>`` / ``cpu_lookups_per_s_t<k>``
    ``k`` threads each looping lookup + retrieve + end_request of a cached prompt on one
    Engine (lock contention, the GIL), against ``memcpy_gbps``: one ``Tensor.copy_`` of the
    same bytes; and ``k`` threads looping lookups of a 16k-token prompt.
``redis_lookup_ms_<n>_tokens``
    ``Engine.lookup`` of an ``n``-token prompt whose chunks are all in redis (a redis-server
    started for the run, CPU memory only staging): hashing, one pipelined ``EXISTS`` round
    trip, pins. Baseline ``redis_contains_ms_<n>_tokens``: the tier's ``contains`` alone.

``--plot PATH`` writes the curves as a PNG (matplotlib).

This module holds the options, the figures and the plot; the curves are measured in
:mod:`~kvtier.bench.scale_lookup` (lookup, redis lookup), :mod:`~kvtier.bench.scale_disk`
(disk restart) and :mod:`~kvtier.bench.scale_cpu` (resident memory, threads).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from kvtier.bench import scale_cpu, scale_disk, scale_lookup


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--lookup-tokens",
        type=_ints,
        default=[4096, 16384, 65536, 262144, 1048576],
        help="prompt lengths for the lookup curve (comma-separated)",
    )
    parser.add_argument(
        "--disk-files",
        type=_ints,
        default=[10_000, 100_000, 1_000_000],
        help="chunk file counts for the disk restart curve",
    )
    parser.add_argument("--rss-chunks", type=int, default=1_000_000, help="chunks for RSS")
    parser.add_argument("--threads", type=_ints, default=[1, 4, 16], help="requesting threads")
    parser.add_argument(
        "--throughput-chunks", type=int, default=4, help="chunks per request (2 MiB each)"
    )
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per thread count")
    parser.add_argument("--redis-tokens", type=int, default=1048576, help="0 skips redis")
    parser.add_argument("--repeats", type=int, default=10, help="lookups per length")
    parser.add_argument(
        "--chunk-size",
        type=int,
        default=scale_lookup.CHUNK,
        help="tokens per chunk of the lookup curve and the redis lookup (the vLLM connector's "
        "default is vLLM's block, 128 on its CPU build)",
    )
    parser.add_argument("--dir", default=None, help="where the disk files go (default: /tmp)")
    parser.add_argument("--plot", default=None, help="write the curves to this PNG")


def run(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {"machine_cpus": os.cpu_count(), "load_avg_1m": _load()}
    curves: dict[str, Any] = {}
    _say("lookup curve")
    result["chunk_size"] = args.chunk_size
    lookup = scale_lookup.lookup_curve(args.lookup_tokens, args.repeats, args.chunk_size)
    curves["lookup"] = lookup
    for n, (ms, hash_ms) in lookup.items():
        result[f"lookup_ms_{label(n)}_tokens"] = round(ms, 3)
        result[f"hash_ms_{label(n)}_tokens"] = round(hash_ms, 3)
    _say("disk restart curve")
    disk = scale_disk.disk_curve(args.disk_files, args.dir, _say)
    curves["disk"] = disk
    for n, row in disk.items():
        result[f"disk_open_s_{label(n)}"] = round(row["open_s"], 3)
        result[f"disk_scan_open_s_{label(n)}"] = round(row["scan_open_s"], 3)
        result[f"disk_save_s_{label(n)}"] = round(row["save_s"], 3)
        result[f"disk_checked_s_{label(n)}"] = round(row["checked_s"], 3)
    result["rss_chunks"] = args.rss_chunks
    _say(f"resident memory of {args.rss_chunks} chunks")
    result["rss_bytes_per_chunk"] = round(scale_cpu.rss_per_chunk(args.rss_chunks))
    _say("CPU tier under concurrent threads")
    throughput = scale_cpu.throughput(args.threads, args.throughput_chunks, args.duration)
    curves["threads"] = throughput
    result["memcpy_gbps"] = round(throughput.pop("memcpy_gbps"), 3)
    for k, row in throughput.items():
        result[f"cpu_retrieve_gbps_t{k}"] = round(row["gbps"], 3)
        result[f"cpu_lookups_per_s_t{k}"] = round(row["lookups_per_s"])
    if args.redis_tokens:
        _say("redis lookup")
        ms, contains_ms = scale_lookup.redis_lookup(
            args.redis_tokens, args.repeats, args.chunk_size
        )
        result[f"redis_lookup_ms_{label(args.redis_tokens)}_tokens"] = round(ms, 3)
        result[f"redis_contains_ms_{label(args.redis_tokens)}_tokens"] = round(contains_ms, 3)
    result["load_avg_1m_end"] = _load()
    if args.plot:
        plot(curves, result, args.plot)
        result["plot"] = args.plot
    return result


def _say(message: str) -> None:
    """Progress on stderr (a full run takes tens of minutes; ``--json`` stays on stdout)."""
    print(f"[bench scale {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def label(n: int) -> str:
    """1048576 -> '1m', 100000 -> '100k', 4096 -> '4k', 100 -> '100' (binary or decimal)."""
    for unit, suffix in ((1 << 20, "m"), (10**6, "m"), (1 << 10, "k"), (10**3, "k")):
        if n >= unit and n % unit == 0:
            return f"{n // unit}{suffix}"
    return str(n)


def _load() -> float:
    return round(os.getloadavg()[0], 2)


# -- the plot --------------------------------------------------------------------------------
def plot(curves: dict[str, Any], result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    lookup = curves.get("lookup", {})
    if lookup:
        xs = sorted(lookup)
        ax = axes[0]
        ax.loglog(xs, [lookup[x][0] for x in xs], "o-", label="Engine.lookup (CPU tier)")
        ax.loglog(xs, [lookup[x][1] for x in xs], "s--", label="hashing alone (baseline)")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("ms")
        ax.set_title("Lookup of a fully cached prompt")
        ax.legend()
    disk = curves.get("disk", {})
    if disk:
        xs = sorted(disk)
        ax = axes[1]
        ax.loglog(xs, [disk[x]["open_s"] for x in xs], "o-", label="with the saved index")
        ax.loglog(xs, [disk[x]["scan_open_s"] for x in xs], "s--", label="header scan")
        ax.set_xlabel("chunk files")
        ax.set_ylabel("s to first hit")
        ax.set_title("Disk tier restart")
        ax.legend()
    threads = {k: v for k, v in curves.get("threads", {}).items() if isinstance(k, int)}
    if threads:
        xs = sorted(threads)
        ax = axes[2]
        ax.plot(xs, [threads[x]["gbps"] for x in xs], "o-", label="retrieve GB/s (all threads)")
        ax.axhline(result.get("memcpy_gbps", 0), color="grey", ls=":", label="memcpy, 1 thread")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("requesting threads")
        ax.set_ylabel("GB/s")
        ax.set_title("CPU tier under concurrent requests")
        ax.legend()
    fig.suptitle(
        f"kvtier bench scale ({result.get('machine_cpus')} CPUs, load "
        f"{result.get('load_avg_1m')}-{result.get('load_avg_1m_end')})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
