"""``kvtier bench s3``: the s3 tier's put/get against the raw S3 client on the same objects.

Without ``--endpoint`` the benchmark starts a SeaweedFS of its own (:mod:`kvtier.bench.seaweedfs`,
signed requests on loopback) and stops it afterwards; with one, it uses the AWS_* environment's
credentials and ``--bucket`` (which must exist).

Baselines, in the same run against the same server: ``raw_put_gbps`` is obstore's PUT of the
same record bytes (header and payload, as the tier sends them) with as many requests in flight
as the tier's writers; ``raw_get_gbps`` is obstore's GET of the same objects with as many in
flight as the tier's readers, each object left in obstore's own buffer (no copy, no check).
The tier's put includes the record header and checksum and the completion callbacks; its get
includes the header check, the payload checksum and landing the bytes in a page. Every round
puts fresh keys (a key the tier already holds would be EXISTS, sending nothing). Tier and
baseline alternate for ``--repeats`` pairs (:func:`kvtier.bench.timing.alternate`): each GB/s
figure is the median of its rounds, ``put_ratio`` / ``get_ratio`` the median of the pairs'
ratios, ``*_min`` / ``*_max`` the lowest and highest pair; ``load_1m`` is the host's load
average when the bench ended.

``lookup_ms`` is ``Engine.lookup`` of a 131072-token prompt (512 chunks of 256 tokens) whose
chunks are all in the bucket and not in CPU memory, by a fresh engine (its index from the
listing at open): hashing, the index and the pins; ``lookup_requests`` counts the S3 requests
each lookup sent (0: the index answers). ``open_ms`` is that engine's open, the listing of the
512 objects included.

``put_ratio`` / ``get_ratio`` below :data:`TARGET` are reported as ``problems`` (the command
exits non-zero after printing the figures); bytes that do not read back are an error.
"""

from __future__ import annotations

import argparse
import os
import secrets
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import numpy as np
import obstore
import torch

from kvtier.bench.checks import require
from kvtier.bench.seaweedfs import SeaweedFS
from kvtier.bench.tier_puts import put_all
from kvtier.bench.timing import alternate, host_load
from kvtier.config import Config
from kvtier.engine import Engine
from kvtier.fingerprint import Fingerprint
from kvtier.layout import KVLayout
from kvtier.storage import records
from kvtier.storage.s3.client import S3Client
from kvtier.storage.s3.options import S3Options, parse_s3_url
from kvtier.storage.s3.tier import S3Tier

BIG_LAYOUT = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
LOOKUP_LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=16, dtype=torch.bfloat16)
LOOKUP_TOKENS = 131072
TARGET = 0.8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--endpoint", default=None, help="an existing S3 endpoint (default: start SeaweedFS)"
    )
    parser.add_argument(
        "--bucket", default="kvtier-bench", help="bucket (must exist with --endpoint)"
    )
    parser.add_argument(
        "--chunk-size", type=int, default=32, help="tokens per chunk (32 = 4 MiB objects)"
    )
    parser.add_argument("--chunks", type=int, default=16, help="objects per round")
    parser.add_argument(
        "--repeats", type=int, default=10, help="tier/raw pairs; their median is reported"
    )
    parser.add_argument(
        "--put-threads", type=int, default=4, help="tier writers, raw PUTs in flight"
    )
    parser.add_argument(
        "--get-threads", type=int, default=8, help="tier readers, raw GETs in flight"
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    with _target(args.endpoint, args.bucket) as (endpoint, bucket, credentials, server):
        result: dict[str, Any] = {"server": server}
        result.update(
            _throughput(
                endpoint,
                bucket,
                credentials,
                args.chunk_size,
                args.chunks,
                args.repeats,
                args.put_threads,
                args.get_threads,
            )
        )
        result.update(_lookup(endpoint, bucket, credentials))
    problems = [
        f"{name} {result[name]} is below the target {TARGET}"
        for name in ("put_ratio", "get_ratio")
        if result[name] < TARGET
    ]
    result["target"] = TARGET
    if problems:
        result["problems"] = problems
    return result


def _options(endpoint: str, bucket: str, credentials: dict[str, str], **kw: Any) -> S3Options:
    return S3Options(
        location=parse_s3_url(f"s3://{bucket}/bench-{secrets.token_hex(4)}"),
        endpoint=endpoint,
        region=credentials.get("region", "us-east-1"),
        credentials=credentials,
        list_interval_s=0.0,
        **kw,
    )


def _throughput(
    endpoint: str,
    bucket: str,
    credentials: dict[str, str],
    chunk_size: int,
    chunks: int,
    repeats: int,
    put_threads: int,
    get_threads: int,
) -> dict[str, Any]:
    layout = BIG_LAYOUT
    fingerprint = Fingerprint("bench-s3", layout, chunk_size)
    chunk_bytes = layout.chunk_bytes(chunk_size)
    nbytes = chunks * chunk_bytes
    rng = np.random.default_rng(0)
    pages = torch.from_numpy(rng.integers(0, 256, (chunks, chunk_bytes), dtype=np.uint8))
    outs = torch.zeros((chunks, chunk_bytes), dtype=torch.uint8)  # touched, as engine pages
    options = _options(
        endpoint,
        bucket,
        credentials,
        timeout_s=60.0,
        put_threads=put_threads,
        get_threads=get_threads,
        inflight_bytes=2 * (nbytes + chunks * records.header_size()),
    )
    tier = S3Tier(options, layout, fingerprint)
    raw = S3Client(endpoint, bucket, credentials, timeout_s=60.0)
    tier.open()
    put_pool, get_pool = ThreadPoolExecutor(put_threads), ThreadPoolExecutor(get_threads)
    tier_rounds: list[list[bytes]] = []  # the keys each round put (fresh every round)
    raw_names: list[list[str]] = []
    try:

        def new_keys() -> list[bytes]:
            return [rng.bytes(16) for _ in range(chunks)]

        def tier_put() -> None:
            keys = new_keys()
            tier_rounds.append(keys)
            put_all(tier, keys, pages, chunk_size)

        def raw_put() -> None:  # the very records the tier sends (header + payload)
            keys = new_keys()
            names = [f"{options.location.prefix}/raw/{k.hex()}" for k in keys]
            raw_names.append(names)

            def one(i: int) -> None:
                header, stored = records.encode_parts(keys[i], fingerprint, chunk_size, pages[i])
                raw.put(names[i], header, stored)

            list(put_pool.map(one, range(chunks)))

        def tier_get() -> None:
            keys = tier_rounds[-1]
            got = tier.get_many_into(list(zip(keys, outs, strict=True)))
            require(got == [chunk_size] * chunks, f"bench get missed: {got}")

        def raw_get() -> None:
            names = raw_names[-1]
            got = list(get_pool.map(lambda n: obstore.get(raw.store, n).bytes(), names))
            require(all(len(g) == len(got[0]) for g in got), "a raw get came back short")

        puts = alternate({"tier": tier_put, "raw": raw_put}, repeats)
        gets = alternate({"tier": tier_get, "raw": raw_get}, repeats)
        require(torch.equal(outs, pages), "the tier read back other bytes than it stored")
        tier.clear()
        for names in raw_names:
            raw.delete(names)
    finally:
        put_pool.shutdown()
        get_pool.shutdown()
        tier.close()
    return {
        "object_bytes": chunk_bytes + records.header_size(),
        "objects": chunks,
        "bytes": nbytes,
        "put_threads": put_threads,
        "get_threads": get_threads,
        "put_gbps": round(puts.gbps("tier", nbytes), 3),
        "get_gbps": round(gets.gbps("tier", nbytes), 3),
        "raw_put_gbps": round(puts.gbps("raw", nbytes), 3),
        "raw_get_gbps": round(gets.gbps("raw", nbytes), 3),
        **puts.ratio("tier", "raw").fields("put_ratio"),
        **gets.ratio("tier", "raw").fields("get_ratio"),
        "pairs": repeats,
        **host_load(),
    }


def _lookup(endpoint: str, bucket: str, credentials: dict[str, str]) -> dict[str, Any]:
    layout, chunk_size = LOOKUP_LAYOUT, 256
    chunks = LOOKUP_TOKENS // chunk_size
    overrides = {
        "chunk_size": chunk_size,
        "remote_url": f"s3://{bucket}/bench-lookup-{secrets.token_hex(4)}",
        "local_cpu": False,
        "use_only_staging_buffer": True,  # CPU only stages: every lookup asks the s3 tier
        "max_local_cpu_size": f"{chunks * layout.chunk_bytes(chunk_size)}B",
        "extra_config": {
            "s3_endpoint_url": endpoint,
            "s3_region": credentials.get("region", "us-east-1"),
            "aws_access_key_id": credentials["access_key_id"],
            "aws_secret_access_key": credentials["secret_access_key"],
        },
    }
    config = Config.load(env={}, overrides=overrides)
    tokens = torch.from_numpy(
        np.random.default_rng(1).integers(0, 32000, LOOKUP_TOKENS, dtype=np.int32)
    )
    with Engine(config, layout, model_name="bench-s3-lookup") as writer:
        writer.store(tokens, torch.zeros(layout.kv_shape(LOOKUP_TOKENS), dtype=layout.dtype))
        require(writer.flush(120.0), "the lookup prompt's writes did not land")
    start = time.perf_counter()
    engine = Engine(config, layout, model_name="bench-s3-lookup").open()
    open_s = time.perf_counter() - start
    tier = engine.tier("s3")
    if not isinstance(tier, S3Tier):  # kept under python -O, as require()
        raise AssertionError(f"the lookup engine has no s3 tier: {tier!r}")
    requests = _count_requests(tier.store.client)
    try:
        timings = []
        for i in range(20):
            start = time.perf_counter()
            hit = engine.lookup(tokens, f"l{i}").tokens
            timings.append(time.perf_counter() - start)
            engine.end_request(f"l{i}")
            require(hit == LOOKUP_TOKENS, f"lookup hit {hit} of {LOOKUP_TOKENS} tokens")
        sent = requests[0]
        engine.clear()
    finally:
        engine.close()
    return {
        "lookup_chunks": chunks,
        "lookup_ms": round(float(np.median(timings)) * 1e3, 3),
        "lookup_requests": sent / 20,  # S3 requests per lookup (the index answers them)
        "open_ms": round(open_s * 1e3, 1),
    }


def _count_requests(client: S3Client) -> list[int]:
    """Count every request ``client`` sends from now on (one cell, read at the end)."""
    count = [0]
    for name in ("put", "put_new", "get", "exists", "delete", "list"):
        method = getattr(client, name)

        def counted(*args: Any, _method: Any = method) -> Any:
            count[0] += 1
            return _method(*args)

        setattr(client, name, counted)
    return count


@contextmanager
def _target(endpoint: str | None, bucket: str) -> Iterator[tuple[str, str, dict[str, str], str]]:
    """(endpoint, bucket, credentials, what it is): the given S3 with the environment's
    credentials, or a SeaweedFS of our own for the duration."""
    if endpoint is not None:
        credentials = {
            "access_key_id": os.environ.get("AWS_ACCESS_KEY_ID", ""),
            "secret_access_key": os.environ.get("AWS_SECRET_ACCESS_KEY", ""),
            "region": os.environ.get("AWS_REGION", "us-east-1"),
        }
        yield endpoint, bucket, credentials, endpoint
        return
    server = SeaweedFS().start()
    try:
        server.create_bucket(bucket)
        yield server.endpoint, bucket, server.credentials_dict(), "seaweedfs (started)"
    finally:
        server.cleanup()
