"""A trace through a whole Engine (CPU tier, disk tier of real files, the manager between):
the same hits as the CPU tier replayed alone when there is no disk, every whole block's
hits when the disk holds them all, and the bench fields with ``--disk-capacity``."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvtier.bench import trace, trace_engine, trace_sims
from kvtier.bench.trace_file import Trace
from kvtier.storage.policy import POLICIES
from tests.bench.test_trace import random_requests, write_trace

BLOCK = 4


def small_trace(seed: int) -> Trace:
    requests = random_requests(seed, 150)
    tokens = [[BLOCK] * (len(r) - 1) + [BLOCK - 1] for r in requests]
    return Trace(requests, tokens, block_tokens=BLOCK)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_an_engine_without_disk_hits_as_its_cpu_tier_alone(policy: str) -> None:
    tr = small_trace(1)
    for capacity in (5, 20, 30):
        engine = trace_engine.replay(tr, capacity, 0, policy)
        assert engine.hit_ratio == engine.cpu_hit_ratio
        assert engine.hit_ratio == pytest.approx(trace.cpu_ratio(tr, capacity, policy))
        assert engine.disk_files_written == 0


def test_a_disk_that_holds_every_block_hits_every_whole_block_again() -> None:
    tr = small_trace(2)
    everything = tr.unique_blocks()
    # CPU pages stage a prompt's writes to disk: room for the longest prompt, or its last
    # chunks are dropped while the first are in flight (kvtier's own rule, not the replay's)
    longest = max(map(len, tr.requests))
    result = trace_engine.replay(tr, longest, everything, "REUSE")
    ideal = trace_sims.replay(tr, trace_sims.Lru(everything, whole_tokens=BLOCK))
    assert result.hit_ratio == pytest.approx(ideal)
    assert result.hit_ratio > result.cpu_hit_ratio  # the disk served some of it
    assert result.disk_bytes_written == result.disk_files_written * trace_engine.FILE_BYTES


def test_bench_trace_with_a_disk_reports_the_pair(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", random_requests(3, 200))
    parser = argparse.ArgumentParser()
    trace.add_arguments(parser)
    args = ["--capacity", "0.05", "--disk-capacity", "0.2", "--block-tokens", "4"]
    result = trace.run(parser.parse_args([str(path), *args]))
    assert result["cpu_hit_ratio"] <= result["hit_ratio"] <= result["inf_hit_ratio"]
    assert result["hit_of_opt"] == pytest.approx(result["hit_ratio"] / result["opt_hit_ratio"])
    assert result["disk_files_written"] > 0
    assert result["disk_bytes_written"] == result["disk_files_written"] * trace_engine.FILE_BYTES
    # Both per-hit figures over the same whole-block hits: their quotient is a file's bytes
    # over a block's tokens.
    per_token, per_chunk = result["disk_bytes_per_hit_token"], result["disk_writes_per_hit_chunk"]
    assert per_chunk > 0 and per_token / per_chunk == pytest.approx(trace_engine.FILE_BYTES / 4)
