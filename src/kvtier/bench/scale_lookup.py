"""The lookup curves of ``kvtier bench scale``: ``Engine.lookup`` of a fully cached prompt
against its length, on the CPU tier (baseline: hashing the key chain alone) and on redis
(baseline: the tier's pipelined ``contains`` alone). See :mod:`kvtier.bench.scale`."""

from __future__ import annotations

import time

import numpy as np
import torch

from kvtier.bench.redis import _server as redis_server
from kvtier.config import Config
from kvtier.engine import Engine
from kvtier.fingerprint import Fingerprint
from kvtier.keys import KeyChain
from kvtier.layout import KVLayout
from kvtier.storage.redis.tier import RedisTier

# Small chunks of bytes: a lookup's cost does not depend on them, and a million tokens fit.
LOOKUP_LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=16, dtype=torch.bfloat16)
CHUNK = 256


def lookup_curve(
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
                hit = engine.lookup(prefix, rid).tokens
                lookups.append(time.perf_counter() - start)
                engine.end_request(rid)
                if hit != n // chunk * chunk:
                    raise RuntimeError(f"lookup of {n} tokens hit {hit}")
                start = time.perf_counter()
                chain.keys(prefix, include_partial=False)
                hashes.append(time.perf_counter() - start)
            out[n] = (float(np.median(lookups)) * 1e3, float(np.median(hashes)) * 1e3)
    return out


def redis_lookup(num_tokens: int, repeats: int, chunk: int = CHUNK) -> tuple[float, float]:
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
                hit = engine.lookup(tokens, f"r{i}").tokens
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
