"""``kvtier bench disk``: the disk tier's writes and reads against plain file I/O.

Layout: 32 layers, 8 KV heads, head dim 128, bf16 (an 8B-class model): 256-token chunks
are 32 MiB. Every repeat, in the same run and the same directory:

* ``write``: ``DiskTier.put`` of every chunk (checksum, temp file, fsync, rename, directory
  fsync, on the writer pool) until every completion callback ran.
  ``raw_write``: for each chunk, one ``pwritev`` of the same bytes to a new file and
  ``fsync``, one after another.
* ``read`` (cold): ``get_many_into`` of every chunk into allocator pages (header check,
  ``preadv`` into the page in 1 MiB pieces each hashed as it lands, checksum compared),
  after dropping the files from the page cache (``posix_fadvise(DONTNEED)``). ``raw_read``:
  one plain ``preadv`` of each raw file into the same pages, after the same drop.
  ``read_cached`` / ``raw_read_cached``: the same again with the files in the page cache
  (memory bound; the checksum shows there).
* ``raw_parallel_*``: the same plain ``pwritev`` / ``preadv`` spread over ``--threads``
  threads, as the tier's pools spread its I/O: the honest baselines, which
  ``*_ratio_parallel`` compare against (the plain ratios are against one thread). A
  parallel raw read is the faster of one whole-file ``preadv`` and ``preadv`` in the tier's
  1 MiB pieces, measured each round.

``--codec NAME`` runs the tier with that payload codec (``disk_codec``) on the synthetic KV
of :mod:`kvtier.bench.codec_data` (identity: random bytes), against the same raw I/O of the
uncompressed payload: the ratios then say whether the codec makes a load or a store slower
(or, reading fewer bytes, faster); ``codec_ratio`` is payload bytes over stored bytes.

Ratios are kvtier over raw (1.0 = no overhead). Best of ``--repeats``; GB/s are decimal and
count payload bytes only. ``checksum_gbps`` is xxh3-128 over the same pages.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import torch

from kvtier.bench.codec_data import kv_page, reads_back
from kvtier.bench.timing import gbps
from kvtier.fingerprint import Fingerprint
from kvtier.layout import KVLayout
from kvtier.memory.block_pool import BlockPool
from kvtier.storage import codecs
from kvtier.storage.base import PutJob, PutOutcome, PutResult
from kvtier.storage.disk.files import READ_BLOCK
from kvtier.storage.disk.options import DiskOptions
from kvtier.storage.disk.tier import DiskTier
from kvtier.storage.records import HEADER_SIZE, payload_checksum
from kvtier.storage.tenants import NO_SALT

BIG_LAYOUT = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chunks", type=int, default=16, help="chunks per round (16 = 512 MiB)")
    parser.add_argument("--chunk-size", type=int, default=256, help="tokens per chunk")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; the best is reported")
    parser.add_argument("--threads", type=int, default=4, help="disk_io_threads of the tier")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument(
        "--codec",
        default="identity",
        choices=[c.name for c in codecs.registered()],
        help="the tier's payload codec (disk_codec)",
    )


class _Completions:
    def __init__(self) -> None:
        self.results: list[PutResult] = []
        self._cond = threading.Condition()

    def __call__(self, result: PutResult) -> None:
        with self._cond:
            self.results.append(result)
            self._cond.notify_all()

    def wait(self, count: int) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: len(self.results) >= count, 600):
                raise RuntimeError("disk writes did not complete in 10 minutes")


def _drop_from_page_cache(directory: Path) -> None:
    for path in directory.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _pwrite_all(fd: int, view: memoryview) -> None:
    done = 0
    while done < view.nbytes:
        done += os.pwritev(fd, [view[done:]], done)


def _pread_all(fd: int, view: memoryview, offset: int = 0) -> None:
    done = 0
    while done < view.nbytes:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise RuntimeError("raw read: file shorter than written")
        done += got


def _rotated(variants: dict[str, Any], shift: int) -> list[str]:
    names = list(variants)
    shift %= len(names)
    return names[shift:] + names[:shift]


def run(args: argparse.Namespace) -> dict[str, Any]:
    layout, chunks, chunk_size = BIG_LAYOUT, int(args.chunks), int(args.chunk_size)
    chunk_bytes = layout.chunk_bytes(chunk_size)
    nbytes = chunks * chunk_bytes
    fingerprint = Fingerprint("bench-disk", layout, chunk_size)
    root = Path(tempfile.mkdtemp(prefix="kvtier-bench-disk-", dir=args.dir))
    tier_dir, raw_dir = root / "tier", root / "raw"
    raw_dir.mkdir()
    record = HEADER_SIZE + chunk_bytes
    options = DiskOptions(str(tier_dir), (chunks + 1) * record, int(args.threads), chunks * record)
    codec = codecs.codec_from_config("--codec", args.codec)
    tier = DiskTier(options, layout, fingerprint, codec)
    pool = BlockPool(chunks, chunk_bytes)
    best: dict[str, float] = {}
    pages: list[torch.Tensor] = []
    workers = ThreadPoolExecutor(int(args.threads))  # the parallel raw baselines

    def raw_write(i: int, suffix: str = "") -> None:
        fd = os.open(raw_dir / f"{i}.raw{suffix}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _pwrite_all(fd, memoryview(pages[i].numpy()))  # type: ignore[arg-type]
            os.fsync(fd)
        finally:
            os.close(fd)

    def raw_read(i: int, suffix: str = "") -> None:
        fd = os.open(raw_dir / f"{i}.raw{suffix}", os.O_RDONLY)
        try:
            _pread_all(fd, memoryview(pages[i].numpy()))  # type: ignore[arg-type]
        finally:
            os.close(fd)

    def raw_read_pieces(i: int, suffix: str = "") -> None:
        # The same 1 MiB preadv pieces the tier uses, minus header and checksum: on this disk
        # a cold file read in pieces came in faster than one whole-file preadv.
        fd = os.open(raw_dir / f"{i}.raw{suffix}", os.O_RDONLY)
        try:
            view = memoryview(pages[i].numpy())  # type: ignore[arg-type]
            for start in range(0, view.nbytes, READ_BLOCK):
                _pread_all(fd, view[start : start + READ_BLOCK], start)
        finally:
            os.close(fd)

    def tier_write(keys: list[bytes]) -> None:
        done = _Completions()
        for key, page in zip(keys, pages, strict=True):
            tier.put(PutJob(key, page, chunk_size, NO_SALT, done))
        done.wait(chunks)
        if any(r.outcome is not PutOutcome.STORED for r in done.results):
            raise RuntimeError(f"disk writes failed: {done.results}")

    def tier_read(keys: list[bytes]) -> None:
        if tier.get_many_into(list(zip(keys, pages, strict=True))) != [chunk_size] * chunks:
            raise RuntimeError("disk tier missed a chunk it holds")

    def each(fn: Callable[[int, str], None]) -> None:
        for i in range(chunks):
            fn(i, "")

    def each_parallel(fn: Callable[[int, str], None]) -> None:
        list(workers.map(fn, range(chunks), [".par"] * chunks))

    def timed(name: str, start: float) -> None:
        best[name] = min(best.get(name, float("inf")), time.perf_counter() - start)

    try:
        pages.extend(pool.page_bytes_view(i) for i in range(chunks))
        gen = torch.Generator().manual_seed(0)
        if codec.is_identity:
            pages[0].copy_(torch.randint(0, 256, (chunk_bytes,), dtype=torch.uint8, generator=gen))
        else:  # random bytes are no KV (NaNs for a lossy codec, incompressible)
            pages[0].copy_(kv_page(layout, chunk_size))
        for i, page in enumerate(pages[1:], start=1):
            page.copy_(pages[0])
            page[:8] = torch.tensor(list(i.to_bytes(8, "little")), dtype=torch.uint8)
        sources = [p.clone() for p in pages]
        tier.open()
        for rep in range(int(args.repeats)):
            keys = [os.urandom(16) for _ in range(chunks)]
            # Each variant takes each position in turn across repeats, so a burst of load
            # from other processes, or writeback of the previous round, favours none.
            writes: dict[str, Callable[[], None]] = {
                "write": partial(tier_write, keys),
                "raw_write": partial(each, raw_write),
                "raw_parallel_write": partial(each_parallel, raw_write),
            }
            reads: dict[str, Callable[[], None]] = {
                "read": partial(tier_read, keys),
                "raw_read": partial(each, raw_read),
                "raw_parallel_read": partial(each_parallel, raw_read),
                "raw_parallel_read_pieces": partial(each_parallel, raw_read_pieces),
            }
            for name in _rotated(writes, rep):
                start = time.perf_counter()
                writes[name]()
                timed(name, start)
            for suffix in ("", "_cached"):
                for name in _rotated(reads, rep):
                    if not suffix:  # cold: dropped before each variant (two read one set)
                        _drop_from_page_cache(tier_dir)
                        _drop_from_page_cache(raw_dir)
                    start = time.perf_counter()
                    reads[name]()
                    timed(name + suffix, start)
                for page in pages:
                    page.zero_()
                tier_read(keys)
                pairs = zip(pages, sources, strict=True)
                if not all(reads_back(codec.lossless, layout, p, s) for p, s in pairs):
                    raise RuntimeError("disk tier read back different bytes")
            tier.clear()
            for path in raw_dir.iterdir():
                path.unlink()

        for _ in range(int(args.repeats)):
            start = time.perf_counter()
            for page in pages:
                payload_checksum(page)
            timed("checksum", start)
    finally:
        workers.shutdown()
        tier.close()
        pool.close()
        shutil.rmtree(root, ignore_errors=True)

    for suffix in ("", "_cached"):  # the parallel raw baseline: whichever way read faster
        pieces = best.pop(f"raw_parallel_read_pieces{suffix}")
        best[f"raw_parallel_read{suffix}"] = min(best[f"raw_parallel_read{suffix}"], pieces)
    rate = {name: gbps(nbytes, seconds) for name, seconds in best.items()}
    stored = memoryview(codec.encode(memoryview(sources[0].numpy()), layout)).nbytes  # type: ignore[arg-type]
    return {
        "codec": codec.name,
        "codec_ratio": chunk_bytes / stored,
        "chunks": chunks,
        "chunk_mib": chunk_bytes / 2**20,
        "io_threads": int(args.threads),
        "write_gbps": rate["write"],
        "raw_write_gbps": rate["raw_write"],
        "write_ratio": rate["write"] / rate["raw_write"],
        "read_gbps": rate["read"],
        "raw_read_gbps": rate["raw_read"],
        "read_ratio": rate["read"] / rate["raw_read"],
        "read_cached_gbps": rate["read_cached"],
        "raw_read_cached_gbps": rate["raw_read_cached"],
        "read_cached_ratio": rate["read_cached"] / rate["raw_read_cached"],
        # The same plain I/O on as many threads as the tier uses: the ratios a tier with
        # no overhead would reach 1.0 on, whatever its concurrency buys it.
        "raw_parallel_write_gbps": rate["raw_parallel_write"],
        "raw_parallel_read_gbps": rate["raw_parallel_read"],
        "raw_parallel_read_cached_gbps": rate["raw_parallel_read_cached"],
        "write_ratio_parallel": rate["write"] / rate["raw_parallel_write"],
        "read_ratio_parallel": rate["read"] / rate["raw_parallel_read"],
        "read_cached_ratio_parallel": rate["read_cached"] / rate["raw_parallel_read_cached"],
        "checksum_gbps": rate["checksum"],
    }
