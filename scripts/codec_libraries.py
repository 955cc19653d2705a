"""Lab script (not part of kvtier): the measurement behind the lossless codec's choice.

Compares zstd, lz4 and blosc2, each with and without a byte-plane shuffle, on one thread,
on the KV of a random-weight tiny Llama (transformers) and on kvtier's synthetic KV
(kvtier.bench.codec_data), bf16 and fp32. Encode and decode times include the shuffle.

    .venv/bin/pip install zstandard==0.25.0 lz4==4.4.5 transformers
    PYTHONPATH=src .venv/bin/python scripts/codec_libraries.py
"""

from __future__ import annotations

import time
from collections.abc import Callable

import blosc2
import lz4.block
import numpy as np
import torch
import zstandard

from kvtier.bench.codec_data import synthetic_kv
from kvtier.layout import KVLayout


def tiny_llama_kv(dtype: torch.dtype) -> torch.Tensor:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():
        cache = model(torch.randint(0, 1000, (1, 256)), use_cache=True).past_key_values
    planes = [
        torch.stack(
            [getattr(layer, name)[0].transpose(0, 1).reshape(256, -1) for layer in cache.layers]
        )
        for name in ("keys", "values")
    ]
    return torch.stack(planes).contiguous()


def best(call: Callable[[], object], repeat: int = 5) -> float:
    call()
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return min(times)


def shuffled(raw: np.ndarray, size: int) -> np.ndarray:
    return np.ascontiguousarray(raw.reshape(-1, size).T).reshape(-1)


def unshuffled(raw: np.ndarray, size: int) -> np.ndarray:
    return np.ascontiguousarray(raw.reshape(size, -1).T).reshape(-1)


def coders(size: int) -> dict[str, tuple[Callable[[np.ndarray], bytes], Callable[[bytes], object]]]:
    out: dict[str, tuple[Callable[[np.ndarray], bytes], Callable[[bytes], object]]] = {}
    for shuffle in (False, True):
        tag = "+shuffle" if shuffle else ""
        pre = (lambda a: shuffled(a, size)) if shuffle else (lambda a: a)
        post = (lambda a: unshuffled(a, size)) if shuffle else (lambda a: a)
        z = zstandard.ZstdCompressor(level=1)
        d = zstandard.ZstdDecompressor()
        out[f"zstd-1{tag}"] = (
            lambda a, z=z, pre=pre: z.compress(pre(a)),
            lambda b, d=d, post=post: post(np.frombuffer(d.decompress(b), np.uint8)),
        )
        out[f"lz4{tag}"] = (
            lambda a, pre=pre: lz4.block.compress(pre(a), store_size=True),
            lambda b, post=post: post(np.frombuffer(lz4.block.decompress(b), np.uint8)),
        )
        for name, codec, level in (
            ("blosc2-zstd-1", blosc2.Codec.ZSTD, 1),
            ("blosc2-lz4", blosc2.Codec.LZ4, 5),
        ):
            f = [blosc2.Filter.SHUFFLE if shuffle else blosc2.Filter.NOFILTER]
            out[f"{name}{tag}"] = (
                lambda a, codec=codec, level=level, f=f: blosc2.compress2(
                    a, typesize=size, codec=codec, clevel=level, filters=f, nthreads=1
                ),
                lambda b: blosc2.decompress2(b, nthreads=1),
            )
    return out


def report(label: str, kv: torch.Tensor) -> None:
    raw = kv.reshape(-1).view(torch.uint8).numpy()
    copy = np.empty_like(raw)
    memcpy = raw.nbytes / best(lambda: np.copyto(copy, raw)) / 1e9
    print(f"{label} {kv.dtype} {raw.nbytes / 2**20:.1f} MiB, memcpy {memcpy:.1f} GB/s")
    for name, (enc, dec) in coders(kv.element_size()).items():
        stored = enc(raw)
        e = raw.nbytes / best(lambda enc=enc: enc(raw)) / 1e9
        d = raw.nbytes / best(lambda dec=dec, stored=stored: dec(stored)) / 1e9
        ratio = raw.nbytes / len(stored)
        print(f"  {name:22s} ratio {ratio:.3f}  enc {e:5.2f}  dec {d:5.2f} GB/s")


def main() -> None:
    torch.set_num_threads(1)
    for dtype in (torch.bfloat16, torch.float32):
        report("tiny-llama", tiny_llama_kv(dtype))
        report("synthetic", synthetic_kv(KVLayout(8, 8, 128, dtype), 256))


if __name__ == "__main__":
    main()
