"""``kvtier bench sliding``: the ways to keep a sliding-window model's records, replayed.

Hand-counted on a trace of three requests sharing a three-block system prompt, then the
orderings that must hold on any trace (with room for everything, per-group records resume where
every token kept does and anchors never later), a tight budget counted by hand, then the
command and its refusals."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.bench import sliding, sliding_sims
from kvtier.bench.sliding_sims import (
    Anchors,
    ColdGroups,
    Every,
    Grid,
    GridCheckpoints,
    Groups,
    SlidingModel,
    replay,
)
from kvtier.bench.trace_file import Trace, chain
from kvtier.errors import InputError
from kvtier.layout import sliding_keep

from .test_trace import random_requests, write_trace

BLOCK = 512
# Gemma-3's window at a GPU block of 16: 1040 tokens, three blocks of 512 before a resume.
GEMMA = SlidingModel(5 / 6, sliding_keep(1024, 16))
INFINITE = float("inf")


def system_prompt_trace() -> Trace:
    """Three prompts: one system prompt of three blocks, each its own two blocks after it,
    and 100 tokens more (a partial block: five whole blocks each)."""
    ids = [[0, 1, 2, 10 + r, 20 + r, 30 + r] for r in range(3)]
    tokens = [[BLOCK] * 5 + [100] for _ in range(3)]
    return Trace(chain(ids), tokens, BLOCK)


def test_every_token_kept_hits_the_system_prompt_from_the_second_request_on() -> None:
    out = replay(system_prompt_trace(), Every(GEMMA, BLOCK, INFINITE))
    assert out.hit_ratio == pytest.approx(2 * 3 * BLOCK / (3 * (5 * BLOCK + 100)))
    assert out.stored_per_token == 1.0


def test_anchors_miss_once_where_a_prompt_first_leaves_the_cached_prefix() -> None:
    """The first prompt keeps whole only its last three blocks (before its end); the second
    finds the system prompt lean, misses, and marks it whole; the third hits it."""
    policy = Anchors(GEMMA, BLOCK, INFINITE)
    assert policy.window == 3
    trace = system_prompt_trace()
    hits = [
        policy.request(ids, sum(t)) for ids, t in zip(trace.requests, trace.tokens, strict=True)
    ]
    assert hits == [0, 0, 3 * BLOCK]
    lean, whole = GEMMA.lean(BLOCK), GEMMA.whole(BLOCK)
    # Stored: the first prompt 2 lean + 3 whole blocks; the second makes blocks 0 and 1
    # whole too (bytes, not tokens) and adds its own 2 whole; the third its own 2 whole.
    assert policy.lru.stored == pytest.approx(2 * lean + 3 * whole + 4 * whole + 2 * whole)
    assert policy.covered == (5 + 2 + 2) * BLOCK


def test_a_chunk_of_four_blocks_resumes_only_at_its_ends() -> None:
    policy = Grid(GEMMA, BLOCK, INFINITE, 4)
    out = replay(system_prompt_trace(), policy)
    assert out.hit_ratio == 0.0  # the shared three blocks end inside the first chunk
    record = (1 / 6) * 2048 + (5 / 6) * 1040
    assert out.stored_per_token == pytest.approx(record / 2048)


def test_groups_resume_where_every_token_does_with_room_for_everything() -> None:
    trace = Trace(random_requests(3), [[BLOCK] * len(r) for r in random_requests(3)], BLOCK)
    every = replay(trace, Every(GEMMA, BLOCK, INFINITE)).hit_ratio
    assert replay(trace, Groups(GEMMA, BLOCK, INFINITE)).hit_ratio == pytest.approx(every)
    assert replay(trace, ColdGroups(GEMMA, BLOCK, INFINITE)).hit_ratio == pytest.approx(every)
    assert replay(trace, Anchors(GEMMA, BLOCK, INFINITE)).hit_ratio <= every


def test_in_tight_bytes_lean_and_cold_parts_keep_the_chat_every_token_loses() -> None:
    """Room for six whole blocks; a nine-block prompt, then its next turn. Every token
    kept: the prompt's first blocks are evicted by its own last ones, so the turn misses.
    Lean records (or cold sliding parts) hold all nine full parts and the last three
    blocks' sliding parts in that room: the turn resumes at block nine."""
    ids = [list(range(10)), list(range(11))]
    tokens = [[BLOCK] * 9 + [100], [BLOCK] * 10 + [100]]
    trace = Trace(chain(ids), tokens, BLOCK)
    room = 6 * BLOCK
    hits = {}
    for policy in (
        Every(GEMMA, BLOCK, room),
        Anchors(GEMMA, BLOCK, room),
        ColdGroups(GEMMA, BLOCK, room),
    ):
        hits[policy.name] = [
            policy.request(i, sum(t)) for i, t in zip(trace.requests, tokens, strict=True)
        ]
    assert hits == {
        "every": [0, 0],
        "anchors": [0, 9 * BLOCK],
        "groups+anchors": [0, 9 * BLOCK],
    }


def test_the_lru_keeps_its_byte_budget_and_counts_what_it_took() -> None:
    lru = sliding_sims.ByteLru(10.0)
    assert lru.insert("a", 6.0) and lru.insert("b", 4.0)
    lru.touch("a")
    assert lru.insert("c", 3.0)  # "b" is the least recently used: it goes
    assert "b" not in lru and "a" in lru and lru.used == 9.0
    assert not lru.insert("d", 11.0)  # larger than the whole budget: never taken
    assert lru.stored == 13.0


def test_the_command_prints_every_policy_at_every_capacity(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", random_requests(5), block_tokens=BLOCK)
    out = subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", "bench", "sliding", str(path), "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(out.stdout)
    assert result["keep"] == sliding_keep(1024, 16)
    names = {"every", "anchors", "groups", "groups+anchors", "chunk 512", "chunk 2048"}
    names |= {"chunk 512+checkpoints", "chunk 4096+checkpoints"}
    assert names <= set(result["stored_per_token"])
    capacities = sliding.CAPACITIES.split(",")
    assert list(result["hit_ratio"]) == capacities
    for point in result["hit_ratio"].values():
        assert all(0.0 <= point[n] <= 1.0 for n in names)
    # Every layer's bytes: the records of "every" cost one token of every layer per token.
    assert result["stored_per_token"]["every"] == 1.0


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--local-global", "5-1"], "--local-global '5-1'"),
        (["--window", "0"], "--window 0"),
        (["--capacity", "0,x"], "--capacity '0,x'"),
        (["--chunks", "1000"], "--chunks '1000'"),
    ],
)
def test_bad_arguments_are_refused_by_name(tmp_path: Path, flags: list[str], named: str) -> None:
    path = write_trace(tmp_path / "t.jsonl", [[0, 1]], block_tokens=BLOCK)
    parser = argparse.ArgumentParser()
    sliding.add_arguments(parser)
    args = parser.parse_args([str(path), *flags])
    with pytest.raises(InputError, match=named.replace("'", ".")):
        sliding.run(args)


def test_checkpoints_resume_a_chats_next_turn_where_its_last_prompt_ended() -> None:
    """A five-block prompt (and 100 tokens), then its next turn: chunks of four blocks alone
    resume the turn at block 4; with the prompt's checkpoint (its five whole blocks, one
    more record of a chunk's bytes) at block 5. A prompt that shares only the system prompt
    (three blocks, inside the first chunk) is missed by both: no prompt ended there."""
    ids = [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 6, 7], [0, 1, 2, 8, 9, 10]]
    tokens = [[BLOCK] * 5 + [100], [BLOCK] * 6 + [100], [BLOCK] * 5 + [100]]
    trace = Trace(chain(ids), tokens, BLOCK)
    hits = {}
    for policy in (Grid(GEMMA, BLOCK, INFINITE, 4), GridCheckpoints(GEMMA, BLOCK, INFINITE, 4)):
        hits[policy.name] = [
            policy.request(i, sum(t)) for i, t in zip(trace.requests, tokens, strict=True)
        ]
        if isinstance(policy, GridCheckpoints):
            record = GEMMA.whole(4 * BLOCK)
            # The first prompt: chunk 0 and its checkpoint (blocks 0-4); the second: its
            # checkpoint (block 5 is new); the third: its own chunk 0 and checkpoint.
            assert policy.lru.stored == pytest.approx(5 * record)
            assert policy.covered == (5 + 1 + 5) * BLOCK
    assert hits == {"chunk 2048": [0, 4 * BLOCK, 0], "chunk 2048+checkpoints": [0, 5 * BLOCK, 0]}
