"""The CPU tier at scale for ``kvtier bench scale``: resident memory per cached chunk (in a
fresh process) and threads sharing one Engine (lookup + retrieve, and lookups alone) against
one thread's memcpy. See :mod:`kvtier.bench.scale`."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvtier.bench.scale_disk import TINY_LAYOUT
from kvtier.bench.timing import best_seconds, gbps
from kvtier.config import Config
from kvtier.engine import Engine
from kvtier.layout import KVLayout

# 2 MiB per 256-token chunk: retrieves move real bytes, so the threads contend for memory
# bandwidth as well as for the engine's locks and the GIL.
THROUGHPUT_LAYOUT = KVLayout(num_layers=8, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)


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


def rss_per_chunk(chunks: int) -> float:
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
def throughput(thread_counts: list[int], chunks: int, duration: float) -> dict[Any, Any]:
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
