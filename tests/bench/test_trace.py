"""``kvtier bench trace`` on small traces written here: the reference caches keep their
order (infinite >= optimum >= any online cache), the real CPU tier matches plain LRU's
arithmetic on a trace where order cannot differ, and bad traces are refused by name."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import pytest

from kvtier.bench import trace, trace_sims
from kvtier.bench.trace_file import Trace, TraceFormatError, chain, load
from kvtier.cli.bench import BENCHMARKS
from kvtier.storage.policy import POLICIES


def write_trace(path: Path, requests: list[list[int]], block_tokens: int = 4) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for ids in requests:
            length = block_tokens * len(ids) - 1  # the last block is partial
            f.write(json.dumps({"input_length": length, "hash_ids": ids}) + "\n")
    return path


def random_requests(seed: int, count: int = 300) -> list[list[int]]:
    """Chained ids: a few shared system prompts, conversations that grow turn by turn."""
    rng = random.Random(seed)
    contents: list[list[int]] = []
    for _ in range(count):
        if contents and rng.random() < 0.5:
            base = rng.choice(contents)
            ids = base + [rng.randrange(1_000_000) for _ in range(rng.randint(1, 4))]
        else:
            ids = [rng.randrange(3)] + [rng.randrange(1_000_000) for _ in range(rng.randint(1, 6))]
        contents.append(ids)
    return chain(contents)


@pytest.mark.parametrize("seed", range(4))
def test_optimum_bounds_every_cache_and_infinite_bounds_the_optimum(seed: int) -> None:
    requests = random_requests(seed)
    tr = Trace(requests, [[4] * len(r) for r in requests], block_tokens=4)
    for capacity in (3, 10, 40):
        opt = trace_sims.replay(tr, trace_sims.Optimum(capacity, tr))
        online = {
            "lru": trace_sims.replay(tr, trace_sims.Lru(capacity)),
            "arc": trace_sims.replay(tr, trace_sims.Arc(capacity)),
        } | {name: trace.cpu_ratio(tr, capacity, name) for name in POLICIES}
        assert all(r <= opt + 1e-12 for r in online.values()), (capacity, opt, online)
        assert opt <= trace_sims.replay(tr, trace_sims.Infinite()) + 1e-12


def test_bench_reports_every_field_and_the_curve(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", random_requests(7, 400))
    parser = argparse.ArgumentParser()
    trace.add_arguments(parser)
    result = trace.run(parser.parse_args([str(path), "--capacity", "0.1", "--block-tokens", "4"]))
    assert "trace" in BENCHMARKS
    fields = ("cpu_hit_ratio", "hit_ratio", "opt_hit_ratio", "lru_hit_ratio", "lru_whole_hit_ratio")
    for field in fields:
        assert 0 < result[field] <= result["inf_hit_ratio"]
    assert set(result["curve"]) == {"0.01", "0.02", "0.05", "0.1", "0.2", "0.4"}
    assert result["curve"]["0.1"]["cpu"] == result["cpu_hit_ratio"]
    need = result["capacity_for_0_9_opt"]
    assert need is None or 0 < need <= 1


def test_rechain_names_each_prefix_once() -> None:
    # contents 5 after 1 and 5 after 2 are different prefixes; 1,5 twice is the same one
    assert chain([[1, 5], [2, 5], [1, 5, 6]]) == [[0, 1], [2, 3], [0, 1, 4]]


def test_a_trace_whose_lengths_disagree_with_the_block_size_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"input_length": 5000, "hash_ids": [1, 2]}) + "\n")
    with pytest.raises(TraceFormatError, match="block-tokens"):
        load(path, block_tokens=512)
    path.write_text(json.dumps({"input_length": 5}) + "\n")
    with pytest.raises(TraceFormatError, match="hash_ids"):
        load(path)


def test_partial_blocks_are_stored_only_with_save_unfull_chunk() -> None:
    # one prompt repeated: its partial last block can hit only when it was stored
    tr = Trace([[0, 1], [0, 1]], [[4, 3], [4, 3]], block_tokens=4)
    assert trace.cpu_ratio(tr, 4, "REUSE") == pytest.approx(4 / 14)
    assert trace.cpu_ratio(tr, 4, "REUSE", save_unfull=True) == pytest.approx(7 / 14)
    assert trace_sims.replay(tr, trace_sims.Lru(4, whole_tokens=4)) == pytest.approx(4 / 14)


@pytest.mark.parametrize("codec", ["fp8", "lossless"])
def test_a_codec_fits_ratio_times_the_blocks_in_the_same_bytes(tmp_path: Path, codec: str) -> None:
    path = write_trace(tmp_path / "t.jsonl", random_requests(9, 400))
    parser = argparse.ArgumentParser()
    trace.add_arguments(parser)
    args = [str(path), "--capacity", "0.05", "--block-tokens", "4", "--codec", codec]
    result = trace.run(parser.parse_args(args))
    blocks, ratio = result["capacity_blocks"], result["codec_ratio"]
    assert result["codec"] == codec and result["ram_bytes"] == blocks * result["block_bytes"]
    assert ratio > (1.9 if codec == "fp8" else 1.2)
    assert result["codec_capacity_blocks"] == int(blocks * ratio)
    assert result["codec_opt_hit_ratio"] >= result["opt_hit_ratio"]
    assert result["codec_of_opt"] == pytest.approx(
        result["codec_hit_ratio"] / result["opt_hit_ratio"]
    )
    # The real coded tier: 1/16 of the bytes are staging pages, the rest slots of the
    # reference chunk's stored size (fp8: one a block; lossless: 1/16 of a block each).
    assert result["codec_staging_pages"] == max(1, blocks // 16)
    per_entry = result["codec_slots_per_entry"]
    held = result["codec_slots"] / per_entry
    assert held == pytest.approx((blocks - result["codec_staging_pages"]) * ratio, rel=0.1)
    assert per_entry == 1 if codec == "fp8" else 1 < per_entry < 16
    assert result["codec_decoded_hits"] > 0 and result["codec_corrupt"] == 0
    if codec == "fp8":  # lossless: its 1.3x less staging and slot rounding can lose here
        assert result["codec_hit_ratio"] > result["cpu_hit_ratio"]
