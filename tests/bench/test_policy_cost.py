"""``python -m kvtier.bench.policy_cost``: a figure per policy and size, each store keeping
the policy at its size (one victim per new key), and an unknown policy refused by name.
Counted, not timed: the figures themselves are the benchmark's, never a test's bar."""

from __future__ import annotations

import json

import pytest

from kvtier.bench import policy_cost
from kvtier.storage.policy import ReusePolicy


def test_every_policy_and_size_gets_a_figure_of_each_call(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert policy_cost.main(["--keys", "600", "--repeats", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["policy"], r["keys"]) for r in rows] == [("LRU", 600), ("REUSE", 600)]
    assert all(r["touch_us"] > 0 and r["store_us"] > 0 for r in rows)


def test_a_store_takes_one_victim_so_the_policy_keeps_its_size() -> None:
    policy, next_key = policy_cost._filled("REUSE", 300)
    assert len(policy) == 300 and next_key == 300 + policy_cost.WARM_STORES
    assert isinstance(policy, ReusePolicy) and policy.panel is not None  # shadows in play


def test_an_unknown_policy_is_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        policy_cost.main(["--policies", "FIFO"])
    assert "FIFO" in capsys.readouterr().err
