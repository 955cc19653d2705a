"""``python -m benchmarks fleet``'s trace and its ideal (fast: no vLLM; the fleet itself runs in
tests/integrations/vllm/test_fleet.py)."""

from __future__ import annotations

import argparse

from benchmarks.fleet import add_arguments, ideal_tokens, trace


def args(**over: int) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parsed = parser.parse_args([])
    for key, value in over.items():
        setattr(parsed, key, value)
    return parsed


def test_the_trace_is_rounds_of_growing_chats_over_two_shared_system_prompts() -> None:
    a = args(users=4, rounds=3, system_tokens=10, first_tokens=5, turn_tokens=2)
    prompts = trace(a, seed=1)
    assert len(prompts) == 12
    assert [len(p) for p in prompts] == [15] * 4 + [17] * 4 + [19] * 4
    assert prompts[0][:10] == prompts[2][:10] != prompts[1][:10]  # users 0 and 2 share one
    assert prompts[4][:15] == prompts[0]  # a user's next round extends its last
    assert trace(a, seed=1) == prompts and trace(a, seed=2) != prompts


def test_the_ideal_counts_every_distinct_prefix_once() -> None:
    assert ideal_tokens([[1, 2, 3], [1, 2, 4], [1, 2, 3, 5], [9]]) == 6
    a = args(users=4, rounds=3, system_tokens=10, first_tokens=5, turn_tokens=2)
    # two system prompts, then each user's own tokens once: 2*10 + 4*(5 + 2*2)
    assert ideal_tokens(trace(a, seed=1)) == 2 * 10 + 4 * (5 + 2 * 2)
