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
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvtier.bench.redis import _server as redis_server
from kvtier.bench.timing import best_seconds, gbps
from kvtier.config import Config
from kvtier.engine import Engine
from kvtier.fingerprint import Fingerprint
from kvtier.keys import KeyChain
from kvtier.layout import KVLayout
from kvtier.storage.disk import files
from kvtier.storage.disk.options import DiskOptions
from kvtier.storage.disk.tier import DiskTier
from kvtier.storage.records import HEADER_SIZE, encode_header
from kvtier.storage.redis.tier import RedisTier

LOOKUP_LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=16, dtype=torch.bfloat16)
TINY_LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.bfloat16)
THROUGHPUT_LAYOUT = KVLayout(num_layers=8, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
CHUNK = 256


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
        default=CHUNK,
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
    lookup = _lookup_curve(args.lookup_tokens, args.repeats, args.chunk_size)
    curves["lookup"] = lookup
    for n, (ms, hash_ms) in lookup.items():
        result[f"lookup_ms_{label(n)}_tokens"] = round(ms, 3)
        result[f"hash_ms_{label(n)}_tokens"] = round(hash_ms, 3)
    _say("disk restart curve")
    disk = _disk_curve(args.disk_files, args.dir)
    curves["disk"] = disk
    for n, row in disk.items():
        result[f"disk_open_s_{label(n)}"] = round(row["open_s"], 3)
        result[f"disk_scan_open_s_{label(n)}"] = round(row["scan_open_s"], 3)
        result[f"disk_save_s_{label(n)}"] = round(row["save_s"], 3)
        result[f"disk_checked_s_{label(n)}"] = round(row["checked_s"], 3)
    result["rss_chunks"] = args.rss_chunks
    _say(f"resident memory of {args.rss_chunks} chunks")
    result["rss_bytes_per_chunk"] = round(_rss_per_chunk(args.rss_chunks))
    _say("CPU tier under concurrent threads")
    throughput = _throughput(args.threads, args.throughput_chunks, args.duration)
    curves["threads"] = throughput
    result["memcpy_gbps"] = round(throughput.pop("memcpy_gbps"), 3)
    for k, row in throughput.items():
        result[f"cpu_retrieve_gbps_t{k}"] = round(row["gbps"], 3)
        result[f"cpu_lookups_per_s_t{k}"] = round(row["lookups_per_s"])
    if args.redis_tokens:
        _say("redis lookup")
        ms, contains_ms = _redis_lookup(args.redis_tokens, args.repeats, args.chunk_size)
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


# -- lookup against prompt length ------------------------------------------------------------
def _lookup_curve(
    lengths: list[int], repeats: int, chunk: int = CHUNK
) -> dict[int, tuple[float, float]]:
    """{tokens: (lookup ms, hash ms)}, medians."""
    if not lengths:
        return {}
    longest = max(lengths)
    layout = LOOKUP_LAYOUT
    chunks = longest // chunk
    config = Config.load(
        env={},
        overrides={
            "chunk_size": chunk,
            "max_local_cpu_size": f"{chunks * layout.chunk_bytes(chunk)}B",
        },
    )
    tokens = torch.from_numpy(np.random.default_rng(1).integers(0, 32000, longest, dtype=np.int32))
    chain = KeyChain(Fingerprint("bench-scale-hash", layout, chunk))
    out: dict[int, tuple[float, float]] = {}
    with Engine(config, layout, model_name="bench-scale-lookup") as engine:
        stored = engine.store(tokens, torch.zeros(layout.kv_shape(longest), dtype=layout.dtype))
        if stored != chunks:
            raise RuntimeError(f"stored {stored} of {chunks} chunks for the lookup curve")
        counter = iter(range(1 << 30))
        for n in sorted(lengths):
            prefix = tokens[:n]
            lookups, hashes = [], []
            for _ in range(max(repeats, 3)):
                rid = f"l{next(counter)}"
                start = time.perf_counter()
                hit = engine.lookup(prefix, rid)
                lookups.append(time.perf_counter() - start)
                engine.end_request(rid)
                if hit != n // chunk * chunk:
                    raise RuntimeError(f"lookup of {n} tokens hit {hit}")
                start = time.perf_counter()
                chain.keys(prefix, include_partial=False)
                hashes.append(time.perf_counter() - start)
            out[n] = (float(np.median(lookups)) * 1e3, float(np.median(hashes)) * 1e3)
    return out


# -- disk restart against file count ---------------------------------------------------------
DISK_FP = Fingerprint("bench-scale-disk", TINY_LAYOUT, 1)


def _write_files(path: str, start: int, stop: int) -> None:
    """Write records for keys start..stop-1 (a worker process: no fsync, test data)."""
    payload = torch.zeros(TINY_LAYOUT.chunk_bytes(1), dtype=torch.uint8)
    body = payload.numpy().tobytes()
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    fp_hex = DISK_FP.hex()
    try:
        for i in range(start, stop):
            key = i.to_bytes(16, "big")
            record = encode_header(key, DISK_FP, 1, payload) + body
            f = os.open(
                files.final_name(fp_hex, key),
                os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                0o644,
                dir_fd=fd,
            )
            try:
                os.write(f, record)
            finally:
                os.close(f)
    finally:
        os.close(fd)


def _fill(path: str, have: int, want: int) -> None:
    if want - have < 20_000:  # starting processes costs more than it saves
        _write_files(path, have, want)
        return
    workers = 2
    step = (want - have + workers - 1) // workers
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(
            target=_write_files, args=(path, have + j * step, min(want, have + (j + 1) * step))
        )
        for j in range(workers)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
        if proc.exitcode != 0:
            raise RuntimeError(f"a file-writing process exited with {proc.exitcode}")


def _disk_curve(counts: list[int], where: str | None) -> dict[int, dict[str, float]]:
    if not counts:
        return {}
    record = HEADER_SIZE + TINY_LAYOUT.chunk_bytes(1)
    top = tempfile.mkdtemp(prefix="kvtier-bench-scale-", dir=where)
    path = os.path.join(top, "chunks")
    os.mkdir(path)
    out: dict[int, dict[str, float]] = {}
    have = 0
    probe = torch.empty(TINY_LAYOUT.chunk_bytes(1), dtype=torch.uint8)
    try:
        for n in sorted(counts):
            _say(f"writing {n - have} chunk files")
            _fill(path, have, n)
            have = n
            _say(f"restarts over {n} files")
            options = DiskOptions(path, capacity_bytes=2 * n * record, io_threads=2)
            index = os.path.join(path, f".{DISK_FP.hex()}.index")
            if os.path.exists(index):
                os.unlink(index)  # no saved index: every header is read
            first_key = (n - 1).to_bytes(16, "big")

            tier, scan_s, _ = _restart(options, first_key, n, probe)
            start = time.perf_counter()
            tier.close()  # saves the index
            save_s = time.perf_counter() - start
            tier, open_s, checked_s = _restart(options, first_key, n, probe)
            tier.close()
            out[n] = {
                "open_s": open_s,
                "scan_open_s": scan_s,
                "save_s": save_s,
                "checked_s": checked_s,
            }
    finally:
        shutil.rmtree(top, ignore_errors=True)
    return out


def _restart(
    options: DiskOptions, key: bytes, n: int, probe: torch.Tensor
) -> tuple[DiskTier, float, float]:
    """Open a disk tier over ``n`` files and serve one hit; (the open tier, seconds to the
    hit, seconds until the background check of a saved index ended)."""
    tier = DiskTier(options, TINY_LAYOUT, DISK_FP)
    start = time.perf_counter()
    tier.open()
    hit = tier.get_into(key, probe)
    took = time.perf_counter() - start
    if not tier.index_checked(3600.0):
        tier.close()
        raise RuntimeError(f"a restart over {n} files: the index check did not end")
    checked = time.perf_counter() - start
    if hit != 1 or tier.usage().entries != n:
        tier.close()
        raise RuntimeError(f"a restart over {n} files found {tier.usage().entries}, hit {hit}")
    return tier, took, checked


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# -- resident memory per cached chunk --------------------------------------------------------
def _rss_child(chunks: int, queue: Any) -> None:
    chunk_size = 16
    layout = TINY_LAYOUT
    batch = min(chunks, 65536)
    config = Config.load(
        env={},
        overrides={
            "chunk_size": chunk_size,
            "max_local_cpu_size": f"{chunks * layout.chunk_bytes(chunk_size)}B",
        },
    )
    rng = np.random.default_rng(3)
    kv = torch.zeros(layout.kv_shape(batch * chunk_size), dtype=layout.dtype)
    with Engine(config, layout, model_name="bench-scale-rss") as engine:
        tokens = rng.integers(0, 32000, batch * chunk_size, dtype=np.int32)
        engine.store(tokens[:chunk_size], kv[:, :, :chunk_size])  # warm every code path
        engine.clear()
        before = _rss()
        stored, seq = 0, 0
        while stored < chunks:
            take = min(batch, chunks - stored)
            tokens = rng.integers(0, 32000, take * chunk_size, dtype=np.int32)
            tokens[0] = seq  # a distinct first token: a distinct key chain per batch
            seq += 1
            stored += engine.store(tokens, kv[:, :, : take * chunk_size])
        after = _rss()
        entries = engine.tier("cpu").usage().entries  # type: ignore[union-attr]
    queue.put(((after - before) / max(entries, 1), entries))


def _rss_per_chunk(chunks: int) -> float:
    """Bytes of resident memory per cached chunk beyond the (pre-touched) page buffer."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_rss_child, args=(chunks, queue))
    proc.start()
    per_chunk, entries = queue.get(timeout=1800)
    proc.join()
    if entries != chunks:
        raise RuntimeError(f"the CPU tier kept {entries} of {chunks} chunks")
    return float(per_chunk)


# -- CPU tier under concurrent requesters ----------------------------------------------------
def _throughput(thread_counts: list[int], chunks: int, duration: float) -> dict[Any, Any]:
    layout = THROUGHPUT_LAYOUT
    chunk_size = 256
    num_tokens = chunks * chunk_size
    nbytes = chunks * layout.chunk_bytes(chunk_size)
    small = 16384
    capacity_chunks = chunks + small // chunk_size
    config = Config.load(
        env={},
        overrides={
            "chunk_size": chunk_size,
            "max_local_cpu_size": f"{capacity_chunks * layout.chunk_bytes(chunk_size)}B",
        },
    )
    rng = np.random.default_rng(5)
    tokens = torch.from_numpy(rng.integers(0, 32000, num_tokens, dtype=np.int32))
    kv = torch.randn(layout.kv_shape(num_tokens)).to(layout.dtype)
    out: dict[Any, Any] = {}
    with Engine(config, layout, model_name="bench-scale-threads") as engine:
        engine.store(tokens, kv)
        dst = torch.empty_like(kv)
        dst.copy_(kv)
        memcpy_s = best_seconds(lambda: dst.copy_(kv), 5)
        out["memcpy_gbps"] = gbps(nbytes, memcpy_s)
        lookup_tokens = torch.from_numpy(rng.integers(0, 32000, small, dtype=np.int32))
        lookup_layout_kv = torch.zeros(layout.kv_shape(small), dtype=layout.dtype)
        engine.store(lookup_tokens, lookup_layout_kv)
        for k in thread_counts:
            buffers = [torch.empty_like(kv) for _ in range(k)]
            for b in buffers:
                b.fill_(0)

            def retrieve(i: int, n: int, buffers: list[torch.Tensor] = buffers) -> None:
                rid = f"t{i}-{n}"
                engine.lookup(tokens, rid)
                if engine.retrieve_into(tokens, rid, buffers[i]) != num_tokens:
                    raise RuntimeError("a concurrent retrieve missed")
                engine.end_request(rid)

            def lookup(i: int, n: int) -> None:
                rid = f"q{i}-{n}"
                engine.lookup(lookup_tokens, rid)
                engine.end_request(rid)

            retrieves, retrieve_s = _run_threads(k, retrieve, duration)
            lookups, lookup_s = _run_threads(k, lookup, duration)
            if not torch.equal(buffers[0], kv):
                raise RuntimeError("a concurrent retrieve returned other bytes")
            out[k] = {
                "gbps": gbps(nbytes * retrieves, retrieve_s),
                "lookups_per_s": lookups / lookup_s,
            }
    return out


def _run_threads(k: int, fn: Callable[[int, int], None], duration: float) -> tuple[int, float]:
    """``k`` threads calling ``fn(thread, n)`` until ``duration`` passes: (total calls,
    seconds from the start until the last thread finished its last call)."""
    counts = [0] * k
    errors: list[BaseException] = []
    start_gate = threading.Barrier(k + 1)
    deadline = [0.0]

    def worker(i: int) -> None:
        start_gate.wait()
        try:
            while time.perf_counter() < deadline[0]:
                fn(i, counts[i])
                counts[i] += 1
        except BaseException as exc:  # reported to the caller
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(k)]
    for thread in threads:
        thread.start()
    start = time.perf_counter()
    deadline[0] = start + duration
    start_gate.wait()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - start
    if errors:
        raise errors[0]
    return sum(counts), elapsed


# -- redis lookup of a long prompt -----------------------------------------------------------
def _redis_lookup(num_tokens: int, repeats: int, chunk: int = CHUNK) -> tuple[float, float]:
    layout = LOOKUP_LAYOUT
    chunks = num_tokens // chunk
    tokens = torch.from_numpy(
        np.random.default_rng(7).integers(0, 32000, num_tokens, dtype=np.int32)
    )
    with redis_server(None) as url:
        config = Config.load(
            env={},
            overrides={
                "chunk_size": chunk,
                "remote_url": url,
                "local_cpu": False,
                "use_only_staging_buffer": True,  # CPU only stages: every lookup asks redis
                "max_local_cpu_size": f"{chunks * layout.chunk_bytes(chunk)}B",
            },
        )
        with Engine(config, layout, model_name="bench-scale-redis") as engine:
            engine.store(tokens, torch.zeros(layout.kv_shape(num_tokens), dtype=layout.dtype))
            engine.flush(300.0)
            timings = []
            for i in range(max(repeats, 3)):
                start = time.perf_counter()
                hit = engine.lookup(tokens, f"r{i}")
                timings.append(time.perf_counter() - start)
                engine.end_request(f"r{i}")
                if hit != chunks * chunk:
                    raise RuntimeError(f"redis lookup hit {hit} of {chunks * chunk} tokens")
            keys = [s.key for s in KeyChain(engine.fingerprint).keys(tokens, include_partial=False)]
            tier = RedisTier.from_config(config, layout, engine.fingerprint)
            tier.open()
            try:
                contains = []
                for _ in range(max(repeats, 3)):
                    start = time.perf_counter()
                    found = tier.contains(keys)
                    contains.append(time.perf_counter() - start)
                if not all(found):
                    raise RuntimeError("contains missed chunks the engine had stored")
            finally:
                tier.close()
    return float(np.median(timings)) * 1e3, float(np.median(contains)) * 1e3


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
