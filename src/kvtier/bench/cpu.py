"""``kvtier bench cpu``: store and retrieve through the CPU tier against a plain tensor copy.

Baseline: ``memcpy_gbps`` is one ``Tensor.copy_`` of the same bytes into memory that was
touched beforehand, the faster of one and two torch threads in each round. A store is a hash
of the tokens, a page allocation and one copy per chunk into the page; a retrieve is a lookup,
pins and one copy per chunk out of the page, so the ratios show the cost kvtier adds.

Each phase alternates the path and its baseline for ``--repeats`` pairs
(:func:`kvtier.bench.timing.alternate`); ``store_ratio`` / ``retrieve_ratio`` are the median
of the pairs' ratios, ``*_ratio_min`` / ``*_ratio_max`` the lowest and highest pair. The GB/s
figures are medians of the rounds (``memcpy_gbps`` over both phases' rounds), ``load_1m`` the
host's load average when the bench ended.

After timing, the buffer the retrieves wrote into is zeroed and the prompt retrieved once
more the same way; the bench fails unless those bytes equal the stored KV (with a lossy
``--codec``: unless they are within 5 % relative L2 error of it).

``--codec NAME`` sets ``cpu_codec`` (one staging page, the coded store sized to hold the
prompt even uncompressed): a store then also encodes each chunk into the coded store, a
retrieve checks and decodes each one into the staging page before its copy out.

``--device cuda`` keeps the KV on the GPU (as an engine's is): a store copies device to host
pages, a retrieve host pages to the device, and the baselines are torch's own copies of the
same bytes between the device and pinned host memory (``d2h_gbps`` for stores, ``h2d_gbps``
for retrieves), the fastest way torch moves them; ``memcpy_gbps`` is then the faster of the two.

On a host, ``streaming_copy_gbps`` is a second baseline in the same rounds: the same bytes
copied with streaming stores on two threads (what the CPU tier's copies use, and the fastest
copy of these bytes here), with ``store_ratio_streaming`` / ``retrieve_ratio_streaming``.

``lookup_128k_ms`` uses a small layout (lookup cost must not depend on chunk bytes): hashing
plus index probe plus pinning of a fully cached 131072-token prompt.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from kvtier.bench.checks import require
from kvtier.bench.timing import alternate, best_seconds, gbps, host_load
from kvtier.config import Config
from kvtier.engine import Engine
from kvtier.fingerprint import Fingerprint
from kvtier.keys import KeyChain
from kvtier.layout import KVLayout
from kvtier.memory.stream_copy import copy_bytes
from kvtier.storage import codecs

BIG_LAYOUT = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
LOSSY_ERROR = 0.05  # relative L2 error a lossy codec's retrieve may show (fp8: ~2.5 %)
LOOKUP_LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=16, dtype=torch.bfloat16)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chunks", type=int, default=16, help="chunks per store (16 = 512 MiB)")
    parser.add_argument(
        "--repeats", type=int, default=9, help="path/baseline pairs; their median is reported"
    )
    parser.add_argument("--chunk-size", type=int, default=256, help="tokens per chunk")
    parser.add_argument(
        "--codec",
        default="identity",
        choices=[c.name for c in codecs.registered()],
        help="cpu_codec: the tier stores through this codec (1/16 of the buffer is staging)",
    )
    parser.add_argument(
        "--device", default="cpu", help="where the KV lives: cpu, or cuda (needs a GPU)"
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    chunk_size: int = args.chunk_size
    chunks: int = args.chunks
    repeats: int = args.repeats
    layout = BIG_LAYOUT
    chunk_bytes = layout.chunk_bytes(chunk_size)
    num_tokens = chunks * chunk_size
    nbytes = chunks * chunk_bytes

    device = _device(args.device)
    kv = torch.randn(layout.kv_shape(num_tokens), dtype=torch.float32).to(device, layout.dtype)
    dst = torch.empty_like(kv)
    dst.copy_(kv)  # touch the destination once, as the engine's buffer is touched at open

    def sync() -> None:  # a device copy has landed when the call returns, as a host one has
        if device.type == "cuda":
            torch.cuda.synchronize()

    codec = codecs.codec_from_config("--codec", args.codec)
    sizes: dict[str, object] = {"max_local_cpu_size": f"{nbytes}B"}
    if not codec.is_identity:  # room for the prompt's chunks even if they do not compress
        sizes = {
            "max_local_cpu_size": f"{nbytes * 17 // 16 + 2 * chunk_bytes}B",
            "cpu_codec_staging": f"{chunk_bytes}B",
        }
    config = Config.load(
        env={},
        overrides={"chunk_size": chunk_size, "cpu_codec": codec.name, **sizes},
    )
    rng = np.random.default_rng(0)
    with (
        Engine(config, layout, model_name="bench-cpu") as engine,
        ThreadPoolExecutor(1, thread_name_prefix="bench-stream-copy") as helper,
    ):
        counter = iter(range(1 << 30))

        def store_fresh() -> None:
            # New tokens each time so every chunk is really stored (the old ones are evicted).
            tokens = rng.integers(0, 32000, num_tokens, dtype=np.int32)
            tokens[0] = next(counter)
            stored = engine.store(tokens, kv)
            sync()
            require(stored == chunks, f"stored {stored} of {chunks} chunks")

        tokens = rng.integers(0, 32000, num_tokens, dtype=np.int32)
        out = torch.empty_like(kv)
        out.copy_(kv)

        def retrieve_once() -> None:
            rid = f"r{next(counter)}"
            engine.lookup(tokens, rid)
            loaded = engine.retrieve_into(tokens, rid, out)
            sync()
            engine.end_request(rid)
            require(loaded == num_tokens, f"loaded {loaded} of {num_tokens} tokens")

        def memcpy_on(threads: int) -> Callable[[], None]:
            def memcpy() -> None:
                before = torch.get_num_threads()
                torch.set_num_threads(threads)
                try:
                    dst.copy_(kv)
                finally:
                    torch.set_num_threads(before)

            return memcpy

        streaming: dict[str, Callable[[], None]] = {}
        if device.type == "cpu":
            baselines = {"memcpy1": memcpy_on(1), "memcpy2": memcpy_on(2)}
            store_base, retrieve_base = baselines, baselines
            streaming = {"stream2": _streaming_copy(dst, kv, helper)}
        else:
            store_base, retrieve_base = _pinned_copies(kv, dst, sync)
        # Half the buffer holds the retrieve's chunks, half the fresh stores' (see max size).
        stores = alternate({**store_base, **streaming, "store": store_fresh}, repeats)
        engine.store(tokens, kv)
        retrieves = alternate({**retrieve_base, **streaming, "retrieve": retrieve_once}, repeats)
        # The check: the timed path once more into a zeroed buffer, so bytes a retrieve did
        # not write (or wrote wrong) cannot pass for the ones the timing loop left there.
        out.zero_()
        retrieve_once()
        error = float((out.float() - kv.float()).norm() / kv.float().norm())
        if error > (0 if codec.lossless else LOSSY_ERROR):
            raise AssertionError(f"bench cpu: retrieved bytes differ from the stored KV ({error})")

    lookup_ms, hash_rate = _lookup_cost(chunk_size, repeats)
    base_s = stores.per_round(list(store_base)) + retrieves.per_round(list(retrieve_base))
    memcpy = gbps(nbytes, statistics.median(base_s))
    store = stores.gbps("store", nbytes)
    retrieve = retrieves.gbps("retrieve", nbytes)
    by_device: dict[str, Any] = {}
    if streaming:  # the fastest copy of these bytes on a host: streaming stores
        by_device["streaming_copy_gbps"] = round(
            gbps(nbytes, statistics.median(stores.per_round(["stream2"]))), 3
        )
        by_device.update(stores.ratio("store", ["stream2"]).fields("store_ratio_streaming"))
        by_device.update(
            retrieves.ratio("retrieve", ["stream2"]).fields("retrieve_ratio_streaming")
        )
    if device.type != "cpu":
        by_device = {"device": str(device)}
        by_device["d2h_gbps"] = round(stores.gbps(list(store_base), nbytes), 3)
        by_device["h2d_gbps"] = round(retrieves.gbps(list(retrieve_base), nbytes), 3)
    return {
        "codec": codec.name,
        **by_device,
        "retrieve_rel_error": error,
        "chunk_bytes": chunk_bytes,
        "chunks": chunks,
        "bytes": nbytes,
        "memcpy_gbps": round(memcpy, 3),
        "store_gbps": round(store, 3),
        "retrieve_gbps": round(retrieve, 3),
        **stores.ratio("store", list(store_base)).fields("store_ratio"),
        **retrieves.ratio("retrieve", list(retrieve_base)).fields("retrieve_ratio"),
        "pairs": repeats,
        "lookup_128k_ms": round(lookup_ms, 4),
        "hash_tokens_per_s": round(hash_rate),
        "torch_threads": torch.get_num_threads(),
        **host_load(),
    }


def _streaming_copy(
    dst: torch.Tensor, src: torch.Tensor, helper: ThreadPoolExecutor
) -> Callable[[], None]:
    """The same bytes copied with streaming stores (no read-for-ownership of ``dst``), half
    on this thread and half on one more: the fastest plain copy two cores make, which the CPU
    tier's own copy threads (:mod:`kvtier.memory.host_copy`) also use."""
    flat_dst = dst.reshape(-1).view(torch.uint8).numpy()
    flat_src = src.reshape(-1).view(torch.uint8).numpy()
    half = flat_src.nbytes // 2

    def copy() -> None:
        other = helper.submit(copy_bytes, flat_dst[half:], flat_src[half:])
        try:
            copy_bytes(flat_dst[:half], flat_src[:half])
        finally:
            other.result()

    return copy


def _device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError:
        device = torch.device("meta")  # not a device torch knows: refused below
    if device.type not in ("cpu", "cuda") or (
        device.type == "cuda" and not torch.cuda.is_available()
    ):
        raise SystemExit(f"bench cpu: --device {name!r}: use cpu, or cuda where torch sees a GPU")
    return device


def _pinned_copies(
    kv: torch.Tensor, dst: torch.Tensor, sync: Callable[[], None]
) -> tuple[dict[str, Callable[[], None]], dict[str, Callable[[], None]]]:
    """torch's device-to-host copy of ``kv`` and host-to-device copy into ``dst`` through
    pinned memory: the baselines of a store from and a retrieve into device memory."""
    host = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=True)

    def d2h() -> None:
        host.copy_(kv, non_blocking=True)
        sync()

    def h2d() -> None:
        dst.copy_(host, non_blocking=True)
        sync()

    return {"d2h_pinned": d2h}, {"h2d_pinned": h2d}


def _lookup_cost(chunk_size: int, repeats: int) -> tuple[float, float]:
    """(ms per lookup of a fully cached 131072-token prompt, tokens hashed per second)."""
    num_tokens = 131072
    layout = LOOKUP_LAYOUT
    chunks = num_tokens // chunk_size
    config = Config.load(
        env={},
        overrides={
            "chunk_size": chunk_size,
            "max_local_cpu_size": f"{chunks * layout.chunk_bytes(chunk_size)}B",
        },
    )
    tokens = np.random.default_rng(1).integers(0, 32000, num_tokens, dtype=np.int32)
    tokens_tensor = torch.from_numpy(tokens)
    with Engine(config, layout, model_name="bench-lookup") as engine:
        engine.store(tokens, torch.zeros(layout.kv_shape(num_tokens), dtype=layout.dtype))
        counter = iter(range(1 << 30))
        timings = []
        for _ in range(max(repeats, 20)):
            rid = f"l{next(counter)}"
            start = time.perf_counter()
            hit = engine.lookup(tokens_tensor, rid).tokens
            timings.append(time.perf_counter() - start)
            engine.end_request(rid)
            require(hit == num_tokens, f"lookup hit {hit} of {num_tokens}")
    chain = KeyChain(Fingerprint("bench-hash", layout, chunk_size))
    hash_s = best_seconds(lambda: chain.keys(tokens, include_partial=False), max(repeats, 20))
    return float(np.median(timings)) * 1e3, num_tokens / hash_s
