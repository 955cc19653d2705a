"""The synthetic traces of ``kvtier bench trace --synthetic``: one trace per (shape, seed) on
every run, the Mooncake rules kept (equal ids, equal prefixes; whole blocks but the last),
a tenant for every request, and each shape's own signature visible in its ids."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import pytest

from kvtier.bench import trace, trace_synthetic
from kvtier.bench.trace_file import load
from kvtier.errors import InputError

BLOCK = trace_synthetic.BLOCK_TOKENS


@pytest.mark.parametrize("name", list(trace_synthetic.SHAPES))
def test_a_shape_is_one_trace_per_seed_and_keeps_the_format(name: str) -> None:
    first = trace_synthetic.generate(name)
    again = trace_synthetic.generate(name)
    other = trace_synthetic.generate(name, seed=trace_synthetic.SEEDS[name] + 1)
    assert first == again
    assert first.requests != other.requests
    assert len(first.requests) == trace_synthetic.REQUESTS == len(first.tenants)
    assert all(first.tenants)
    parents: dict[int, int] = {}  # chained ids: one parent per id, or equal ids lie
    for ids, tokens in zip(first.requests, first.tokens, strict=True):
        assert tokens[:-1] == [BLOCK] * (len(ids) - 1) and 0 < tokens[-1] < BLOCK
        for parent, child in zip([-1, *ids], ids, strict=False):
            assert parents.setdefault(child, parent) == parent
    # each prompt's partial last block is its own: no later prompt repeats it
    lasts = Counter(ids[-1] for ids in first.requests)
    assert max(lasts.values()) == 1
    # the same size class as the conversation trace (12,031 requests, 288,500 accesses)
    assert 100_000 < first.accesses < 500_000


def test_the_scanning_tenant_never_reuses_past_its_system_prompt() -> None:
    tr = trace_synthetic.generate("multi-tenant-scan")
    assert set(tr.tenants) == {"t0", "t1", "t2", "t3", "scan"}
    uses = Counter(b for ids in tr.requests for b in ids)
    scans = [ids for ids, t in zip(tr.requests, tr.tenants, strict=True) if t == "scan"]
    assert 0.25 < len(scans) / len(tr.requests) < 0.35
    assert all(uses[b] == 1 for ids in scans for b in ids[1:])
    assert all(uses[ids[0]] == len(scans) for ids in scans)


def test_popularity_shift_changes_the_hot_documents() -> None:
    tr = trace_synthetic.generate("popularity-shift")

    def hottest(lo: int, hi: int) -> set[int]:  # the most used first document block
        counts = Counter(ids[2] for ids in tr.requests[lo:hi])
        return {b for b, _ in counts.most_common(10)}

    assert len(hottest(0, 2_000) & hottest(2_000, 4_000)) <= 2
    assert len(hottest(0, 1_000) & hottest(1_000, 2_000)) >= 5


def test_long_chat_conversations_come_back_after_a_long_gap() -> None:
    tr = trace_synthetic.generate("long-chat")
    last_seen: dict[int, int] = {}
    gaps = []
    for n, ids in enumerate(tr.requests):
        seen = next((i for i, b in enumerate(ids) if b not in last_seen), len(ids))
        if seen > 4:  # a conversation past its first turn: how long since its last one
            gaps.append(n - last_seen[ids[seen - 1]])
        for b in ids:
            last_seen[b] = n
    assert sum(g >= 500 for g in gaps) > 200


def test_a_synthetic_trace_round_trips_through_jsonl_with_its_tenants(tmp_path: Path) -> None:
    tr = trace_synthetic.generate("multi-tenant-scan")
    path = tmp_path / "t.jsonl"
    path.write_text("".join(line + "\n" for line in trace_synthetic.jsonl(tr)))
    assert json.loads(path.read_text().splitlines()[0])["tenant"] in set(tr.tenants)
    assert load(path) == tr


def test_an_unknown_shape_is_refused_naming_the_valid_ones() -> None:
    with pytest.raises(InputError, match="few-shot"):
        trace_synthetic.generate("zipf")


def test_bench_trace_replays_a_synthetic_shape_by_name() -> None:
    parser = argparse.ArgumentParser()
    trace.add_arguments(parser)
    args = parser.parse_args(["--synthetic", "few-shot"])
    tr = trace.load_trace(args)
    assert tr == trace_synthetic.generate("few-shot")
    assert len(tr.requests) == trace_synthetic.REQUESTS
