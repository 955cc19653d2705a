"""A trace replayed through a whole :class:`~kvtier.engine.Engine`: its CPU tier, its disk
tier with real files, and the storage manager between them (``kvtier bench trace
--disk-capacity``).

Each block id of the trace is one token and each chunk one token (``chunk_size`` 1), so a
request's chunk keys chain exactly as the trace's ids do (equal ids, equal prefixes). The
layout is one layer of one head of width 1 in float32: 8 bytes of KV a chunk, a 4,104-byte
file on disk (the record's 4 KiB header and its payload). Per request, as an inference
engine drives kvtier::

    lookup(ids) -> h       the cached prefix, pinned (CPU first, then the disk)
    retrieve(ids)          loads it: a disk hit is read, checked and copied back to CPU
    end_request
    store(whole blocks)    the prompt's chunks not held (a partial last block only with
                           save_unfull_chunk, as kvtier stores), written through to disk
    flush                  the disk writes land before the next request (a replay, not a
                           race: the same trace gives the same figures)

Hit tokens are the trace's tokens of the first ``h`` blocks. The disk directory is made under
``/dev/shm`` when it exists (the figures are about which chunks are kept, not how fast a
disk is) and removed after.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier.bench.trace_file import Trace
from kvtier.config import Config
from kvtier.engine import Engine
from kvtier.layout import KVLayout
from kvtier.storage.records import HEADER_SIZE

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32)
CHUNK_BYTES = LAYOUT.chunk_bytes(1)
FILE_BYTES = HEADER_SIZE + CHUNK_BYTES


@dataclass(frozen=True, slots=True)
class EngineReplayResult:
    hit_ratio: float
    cpu_hit_ratio: float  # of all prompt tokens, those served from CPU memory
    disk_bytes_written: int
    disk_files_written: int
    hit_tokens: int
    hit_blocks: int


def replay(
    trace: Trace,
    cpu_blocks: int,
    disk_blocks: int,
    policy: str,
    *,
    save_unfull: bool = False,
) -> EngineReplayResult:
    """Replay ``trace`` through an Engine of ``cpu_blocks`` chunks in memory and, when
    ``disk_blocks`` > 0, a disk tier of that many chunk files."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    directory = tempfile.mkdtemp(prefix="kvtier-trace-", dir=base)
    values: dict[str, object] = {
        "chunk_size": 1,
        "max_local_cpu_size": f"{max(cpu_blocks, 1) * CHUNK_BYTES}B",
        "cache_policy": policy,
        "save_unfull_chunk": save_unfull,
        "extra_config": {"explain_requests": 0},
    }
    if disk_blocks > 0:
        values |= {"local_disk": directory, "max_local_disk_size": f"{disk_blocks * FILE_BYTES}B"}
    engine = Engine(Config.load(overrides=values, env={}), LAYOUT, model_name="trace").open()
    try:
        hit_tokens, hit_blocks, cpu_tokens = _run(engine, trace, save_unfull)
        disk = engine.tier("disk")
        written = disk.counters.bytes_written if disk is not None else 0
        stored = disk.counters.stored if disk is not None else 0
    finally:
        engine.close()
        shutil.rmtree(directory, ignore_errors=True)
    total = trace.total_tokens
    return EngineReplayResult(
        hit_tokens / total, cpu_tokens / total, written, stored, hit_tokens, hit_blocks
    )


def _run(engine: Engine, trace: Trace, save_unfull: bool) -> tuple[int, int, int]:
    hit_tokens = hit_blocks = cpu_tokens = 0
    whole = trace.block_tokens
    zeros = torch.zeros(LAYOUT.kv_shape(max(map(len, trace.requests), default=1)))
    for number, (ids, tokens) in enumerate(zip(trace.requests, trace.tokens, strict=True)):
        rid = f"r{number}"
        hit = engine.lookup(ids, rid)
        if hit.tokens:
            loaded = engine.retrieve(ids, rid).shape[2]
            hit_tokens += sum(tokens[:loaded])
            hit_blocks += loaded
            cpu_tokens += sum(tokens[: min(hit.cpu_tokens, loaded)])
        engine.end_request(rid)
        keep = len(ids) if save_unfull or tokens[-1] >= whole else len(ids) - 1
        if keep:
            engine.store(ids[:keep], zeros[:, :, :keep, :])
            engine.flush()
    return hit_tokens, hit_blocks, cpu_tokens


def ids_fit(requests: Sequence[Sequence[int]]) -> bool:
    """Block ids are token ids here: they must fit an int32."""
    return all(0 <= b < 2**31 for ids in requests for b in ids)
