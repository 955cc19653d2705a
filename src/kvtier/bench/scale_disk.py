"""The disk restart curve of ``kvtier bench scale``: ``DiskTier.open`` over ``n`` chunk files
until its first hit, with the index a clean close saved and with none (a header scan). The
files are written straight to the directory by worker processes. See
:mod:`kvtier.bench.scale`."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import Callable

import torch

from kvtier.fingerprint import Fingerprint
from kvtier.layout import KVLayout
from kvtier.storage.disk import files
from kvtier.storage.disk.options import DiskOptions
from kvtier.storage.disk.tier import DiskTier
from kvtier.storage.records import HEADER_SIZE, encode_header

# A chunk of 1 token, 8 payload bytes: open cost is per file, not per byte, and tiny files
# let a million be written in minutes (the RSS curve uses it too: bookkeeping, not payload).
TINY_LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.bfloat16)
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


def disk_curve(
    counts: list[int], where: str | None, say: Callable[[str], None]
) -> dict[int, dict[str, float]]:
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
            say(f"writing {n - have} chunk files")
            _fill(path, have, n)
            have = n
            say(f"restarts over {n} files")
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
