"""``kvtier bench redis``: the redis tier's put/get against raw RESP over plain sockets.

Baselines, in the same run against the same server (:mod:`kvtier.bench.raw_resp`):
``raw_get_gbps`` is ``GET`` over one socket read with ``recv_into`` straight into a buffer
allocated and touched beforehand (no client library, no allocation per value);
``raw_set_gbps`` is ``SET`` of the same record bytes sent as they are, the best of one socket
and of ``--put-threads`` sockets in parallel (the tier's writers get as many connections).
The tier's put includes the record header and checksum and the completion callbacks; its
get includes the header check, the payload checksum and landing the bytes in a page. Each
figure is the best of ``--repeats`` rounds, tier and baseline taking turns in every round.
``redispy_get_gbps`` / ``redispy_set_gbps`` are plain redis-py ``GET`` (returning ``bytes``)
and ``SET``, for reference only.

``--codec NAME`` runs the tier with that payload codec (``remote_codec``) on the synthetic KV
of :mod:`kvtier.bench.codec_data` (identity: random bytes); the raw baselines move the
uncompressed records, so ``put_ratio`` / ``get_ratio`` say whether the codec makes a store
or a load slower (or, moving fewer bytes, faster).

``lookup_ms`` is ``Engine.lookup`` of a 131072-token prompt (512 chunks of 256 tokens, a
small layout) whose chunks are all in redis and not in CPU memory: hashing, one pipelined
``EXISTS`` round trip and the pins. ``contains_ms`` is the tier's part alone.

Without ``--url`` the benchmark starts its own redis-server on a free loopback port
(persistence off) and stops it afterwards.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import redis
import torch

from kvtier.bench.codec_data import kv_page, reads_back
from kvtier.bench.raw_resp import RawResp
from kvtier.bench.redis_quota import quota_costs
from kvtier.bench.tier_puts import put_all
from kvtier.bench.timing import best_interleaved, gbps
from kvtier.config import Config
from kvtier.config.remote_url import mask_password, parse_remote_url
from kvtier.engine import Engine
from kvtier.errors import ConfigError
from kvtier.fingerprint import Fingerprint
from kvtier.keys import KeyChain
from kvtier.layout import KVLayout
from kvtier.storage import codecs, records
from kvtier.storage.codecs import PayloadCodec
from kvtier.storage.redis.options import RedisOptions
from kvtier.storage.redis.tier import RedisTier

BIG_LAYOUT = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
LOOKUP_LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=16, dtype=torch.bfloat16)
LOOKUP_TOKENS = 131072


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=None, help="an existing server (default: start one)")
    parser.add_argument(
        "--chunk-size", type=int, default=128, help="tokens per chunk (128 = 16 MiB values)"
    )
    parser.add_argument("--chunks", type=int, default=16, help="values per round")
    parser.add_argument("--repeats", type=int, default=5, help="rounds; best is reported")
    parser.add_argument("--put-threads", type=int, default=2, help="tier writer threads")
    parser.add_argument(
        "--codec",
        default="identity",
        choices=[c.name for c in codecs.registered()],
        help="the tier's payload codec (remote_codec)",
    )
    parser.add_argument(
        "--quota",
        action="store_true",
        help="only what tenant_quotas cost a put (small records; --url may be a cluster)",
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    if getattr(args, "quota", False):  # tenant_quotas' cost alone (kvtier.bench.redis_quota)
        with _server(args.url) as url:
            return quota_costs(url, args.chunk_size, args.repeats, args.put_threads)
    with _server(args.url) as url:
        codec = codecs.codec_from_config("--codec", getattr(args, "codec", "identity"))
        result = _throughput(
            url, args.chunk_size, args.chunks, args.repeats, args.put_threads, codec
        )
        result.update(_lookup(url))
    return result


def _throughput(
    url: str,
    chunk_size: int,
    chunks: int,
    repeats: int,
    put_threads: int,
    codec: PayloadCodec = codecs.IDENTITY,
) -> dict[str, Any]:
    layout = BIG_LAYOUT
    fingerprint = Fingerprint("bench-redis", layout, chunk_size)
    chunk_bytes = layout.chunk_bytes(chunk_size)
    nbytes = chunks * chunk_bytes
    rng = np.random.default_rng(0)
    pages = torch.from_numpy(rng.integers(0, 256, (chunks, chunk_bytes), dtype=np.uint8))
    if not codec.is_identity:  # random bytes are no KV (NaNs for a lossy codec)
        pages[:] = kv_page(layout, chunk_size)
    out = torch.empty(chunk_bytes, dtype=torch.uint8)
    out.fill_(0)  # touched once, as an engine's pages are
    keys = [rng.bytes(16) for _ in range(chunks)]
    options = RedisOptions(
        timeout_s=60.0, put_threads=put_threads, inflight_bytes=2 * (nbytes + chunks * 4096)
    )
    tier = RedisTier(parse_remote_url(url), layout, fingerprint, options, codec)
    tier.open()
    if not tier.store.link.wait_up(10.0):
        tier.close()
        shown = mask_password(url)
        raise ConfigError("remote_url", shown, "a redis server that answers (bench --url)")
    raw = redis.Redis.from_url(url, socket_timeout=60.0)
    target = parse_remote_url(url)
    host, port = target.nodes[0]
    sockets = [RawResp(host, port, 60.0) for _ in range(max(1, put_threads))]
    try:
        values = [
            records.encode_record(k, fingerprint, chunk_size, pages[i]) for i, k in enumerate(keys)
        ]
        raw_names = [b"kvtier-bench-raw:" + k.hex().encode() for k in keys]
        raw_out = bytearray(len(values[0]))
        raw_out[:] = values[0]  # touched once, like the tier's page
        raw_view = memoryview(raw_out)

        def tier_put() -> None:
            put_all(tier, keys, pages, chunk_size)

        def tier_get() -> None:
            for key in keys:
                if tier.get_into(key, out) != chunk_size:
                    raise RuntimeError("bench get missed a chunk it had just stored")

        def raw_set_on(sock: RawResp, share: range) -> None:
            for i in share:
                sock.set(raw_names[i], [values[i]])

        def raw_set_one() -> None:
            raw_set_on(sockets[0], range(len(keys)))

        def raw_set_parallel() -> None:
            n = len(sockets)
            threads = [
                threading.Thread(target=raw_set_on, args=(s, range(j, len(keys), n)))
                for j, s in enumerate(sockets)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()

        def raw_get() -> None:
            for name in raw_names:
                sockets[0].get_into(name, raw_view)

        def redispy_set() -> None:
            for name, value in zip(raw_names, values, strict=True):
                raw.set(name, value)

        def redispy_get() -> None:
            for name in raw_names:
                if raw.get(name) is None:
                    raise RuntimeError("redis-py get missed")

        puts = best_interleaved(
            {
                "tier": tier_put,
                "raw1": raw_set_one,
                "rawN": raw_set_parallel,
                "redispy": redispy_set,
            },
            repeats,
        )
        gets = best_interleaved({"tier": tier_get, "raw": raw_get, "redispy": redispy_get}, repeats)
        if not reads_back(codec.lossless, layout, out, pages[-1]):
            raise RuntimeError("bytes read back differ from the bytes stored")
        if raw_out != values[-1]:
            raise RuntimeError("raw GET read back other bytes than it stored")
        tier.clear()
        raw.delete(*raw_names)
    finally:
        for sock in sockets:
            sock.close()
        raw.close()
        tier.close()
    put, get = gbps(nbytes, puts["tier"]), gbps(nbytes, gets["tier"])
    raw_set_rate = gbps(nbytes, min(puts["raw1"], puts["rawN"]))
    raw_get_rate = gbps(nbytes, gets["raw"])
    stored = memoryview(codec.encode(memoryview(pages[0].numpy()), layout)).nbytes  # type: ignore[arg-type]
    return {
        "codec": codec.name,
        "codec_ratio": chunk_bytes / stored,
        "value_bytes": chunk_bytes + records.header_size(),
        "values": chunks,
        "bytes": nbytes,
        "put_threads": put_threads,
        "put_gbps": round(put, 3),
        "get_gbps": round(get, 3),
        "raw_set_gbps": round(raw_set_rate, 3),
        "raw_set_1_socket_gbps": round(gbps(nbytes, puts["raw1"]), 3),
        "raw_get_gbps": round(raw_get_rate, 3),
        "put_ratio": round(put / raw_set_rate, 3),
        "get_ratio": round(get / raw_get_rate, 3),
        "redispy_set_gbps": round(gbps(nbytes, puts["redispy"]), 3),
        "redispy_get_gbps": round(gbps(nbytes, gets["redispy"]), 3),
    }


def _lookup(url: str) -> dict[str, Any]:
    layout, chunk_size = LOOKUP_LAYOUT, 256
    chunks = LOOKUP_TOKENS // chunk_size
    config = Config.load(
        env={},
        overrides={
            "chunk_size": chunk_size,
            "remote_url": url,
            "local_cpu": False,
            "use_only_staging_buffer": True,  # CPU only stages: every lookup asks redis
            "max_local_cpu_size": f"{chunks * layout.chunk_bytes(chunk_size)}B",
        },
    )
    tokens = torch.from_numpy(
        np.random.default_rng(1).integers(0, 32000, LOOKUP_TOKENS, dtype=np.int32)
    )
    with Engine(config, layout, model_name="bench-redis-lookup") as engine:
        engine.store(tokens, torch.zeros(layout.kv_shape(LOOKUP_TOKENS), dtype=layout.dtype))
        engine.flush(60.0)
        timings = []
        for i in range(20):
            start = time.perf_counter()
            hit = engine.lookup(tokens, f"l{i}").tokens
            timings.append(time.perf_counter() - start)
            engine.end_request(f"l{i}")
            if hit != LOOKUP_TOKENS:
                raise RuntimeError(f"lookup hit {hit} of {LOOKUP_TOKENS} tokens")
        keys = [
            span.key for span in KeyChain(engine.fingerprint).keys(tokens, include_partial=False)
        ]
        tier = RedisTier.from_config(config, layout, engine.fingerprint)
        tier.open()
        try:
            contains = []
            for _ in range(20):
                start = time.perf_counter()
                found = tier.contains(keys)
                contains.append(time.perf_counter() - start)
            if not all(found):
                raise RuntimeError("contains missed chunks the engine had stored")
            tier.clear()
        finally:
            tier.close()
    return {
        "lookup_chunks": chunks,
        "lookup_ms": round(float(np.median(timings)) * 1e3, 3),
        "contains_ms": round(float(np.median(contains)) * 1e3, 3),
    }


@contextmanager
def _server(url: str | None) -> Iterator[str]:
    """``url`` as is, or a redis-server of our own for the duration."""
    if url is not None:
        yield url
        return
    binary = shutil.which("redis-server")
    if binary is None:
        raise ConfigError("remote_url", None, "--url, or redis-server installed on PATH")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    workdir = tempfile.TemporaryDirectory(prefix="kvtier-bench-redis-")
    command = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly"]
    command += ["no", "--dir", workdir.name]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = redis.Redis(port=port, socket_timeout=1.0, socket_connect_timeout=1.0)
        deadline = time.monotonic() + 15
        while True:
            try:
                client.ping()
                break
            except redis.RedisError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the benchmark's redis-server did not start") from None
                time.sleep(0.05)
        client.close()
        yield f"redis://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        workdir.cleanup()
