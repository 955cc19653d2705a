"""Failed loads on the worker side, without vLLM's processes: vLLM must be told exactly which
blocks a load could not fill (``failed_blocks``) and how far it got (``short_loads``), for a
chunk that fails its checksum mid-load and for a load that crashes. A greedy token or two of
a random model would hardly notice a few wrong blocks, so these assert the block ids.

Only the worker side's public behaviour is used: ``WorkerSide.load``, ``failed_blocks``,
``short_loads``, ``finished_loads`` and its lookup socket.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvtier.integrations.vllm.metadata import KVTierMetadata, LoadSpec, SaveSpec
from kvtier.integrations.vllm.rpc import LookupClient
from kvtier.integrations.vllm.worker import WorkerSide

from .worker_helpers import BLOCK, CHUNK, CHUNK_BYTES, fill, make_worker

TOKENS = list(range(700, 800))  # 100 tokens: three whole chunks (96) and four more
SRC = [3, 4, 5, 6, 7, 8]  # the six blocks of the three chunks, in the first worker
DST = [40, 41, 42, 43, 44, 45, 46]  # the request's blocks in the restarted worker


@pytest.fixture
def restarted(tmp_path: Path) -> Iterator[tuple[WorkerSide, list[torch.Tensor]]]:
    """A worker restarted on a disk directory holding the three chunks of ``TOKENS`` (its CPU
    tier empty: every hit is read from disk and checked), and the chunks' blocks as the first
    worker saved them, per layer."""
    assert CHUNK == 2 * BLOCK  # the block ids the tests expect assume it
    disk = {"local_disk": str(tmp_path), "max_local_disk_size": f"{64 * CHUNK_BYTES}B"}
    first = make_worker(**disk)
    fill(first, SRC, seed=11)
    first.save(KVTierMetadata(saves=[SaveSpec("w", TOKENS[:96], SRC, 0, 96)]))
    assert first.paged is not None
    saved = [layer[SRC].clone() for layer in first.paged.layers]
    first.close()  # drains the disk writes
    second = make_worker(**disk)
    try:
        yield second, saved
    finally:
        second.close()


def corrupt_chunk(worker: WorkerSide, directory: Path, index: int) -> None:
    """Flip one payload byte of chunk ``index`` of ``TOKENS`` in its disk file."""
    assert worker.engine is not None
    key = worker.engine.keychain.keys(TOKENS, include_partial=False)[index].key
    path = directory / f"{worker.engine.fingerprint.hex()}-{key.hex()}.kvc"
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01
    path.write_bytes(bytes(data))


def wait_finished(worker: WorkerSide, rid: str) -> None:
    deadline = time.monotonic() + 20
    done: set[str] = set()
    while rid not in done:
        assert time.monotonic() < deadline, f"load of {rid} never reported finished"
        done |= worker.finished_loads()
        time.sleep(0.01)


@pytest.mark.parametrize("async_load", [True, False], ids=["background", "in-step"])
def test_a_checksum_failure_mid_load_reports_exactly_the_blocks_from_that_chunk_on(
    restarted: tuple[WorkerSide, list[torch.Tensor]], tmp_path: Path, async_load: bool
) -> None:
    worker, saved = restarted
    corrupt_chunk(worker, tmp_path, 1)  # the second of three chunks: tokens 32..63
    client = LookupClient(worker.engine_id)
    try:
        assert client.lookup("r", TOKENS).tokens == 96  # the index cannot know yet
        worker.load(KVTierMetadata(loads=[LoadSpec("r", TOKENS, DST, 0, 96, async_load)]))
        if async_load:
            wait_finished(worker, "r")
        # Chunk 0 (blocks DST[0:2]) arrived; from chunk 1 on (tokens 32..95: DST[2:6]) vLLM
        # must recompute, and nothing past the load's end (DST[6]) is named.
        assert worker.failed_blocks() == {42, 43, 44, 45}
        assert worker.short_loads() == {"r": 32}
        assert worker.paged is not None
        for layer, want in zip(worker.paged.layers, saved, strict=True):
            assert torch.equal(layer[DST[:2]], want[:2])  # what was served is right
            assert not layer[DST[2:]].any()  # nothing of the bad chunk or after it landed
        assert worker.engine is not None
        assert worker.engine.tier("disk").counters.corrupt == 1  # type: ignore[union-attr]
        assert client.end("r") is True
        assert worker.engine.leaks() == [] and worker.engine.check_invariants() == []
    finally:
        client.close()


def test_a_background_load_that_crashes_fails_every_block_it_was_to_fill(
    restarted: tuple[WorkerSide, list[torch.Tensor]],
) -> None:
    """The loader thread's crash branch: something other than a kvtier error escapes the load
    (here writing to a block id past the end of vLLM's KV cache raises IndexError while the
    chunks are scattered into blocks). vLLM must not wait forever, and must recompute every
    block from the load's start on: the request is reported finished, and failed from
    ``start`` (16: the first block is vLLM's own) to the end."""
    worker, _ = restarted
    blocks = [40, 41, 10_000, 43, 44, 45, 46]
    client = LookupClient(worker.engine_id)
    try:
        assert client.lookup("c", TOKENS).tokens == 96
        worker.load(KVTierMetadata(loads=[LoadSpec("c", TOKENS, blocks, 16, 96, True)]))
        wait_finished(worker, "c")
        assert worker.failed_blocks() == set(blocks[16 // BLOCK :])
        assert worker.short_loads() == {"c": 16}
        assert worker.finished_loads() == set() and worker.failed_blocks() == set()  # taken
        assert client.end("c") is True
        assert worker.engine is not None
        assert worker.engine.leaks() == [] and worker.engine.check_invariants() == []
    finally:
        client.close()
