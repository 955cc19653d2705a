"""The pairing every transfer bench times with (:mod:`kvtier.bench.timing`): the order of the
runs, and the median ratio of the pairs with its spread. Never a timing of the host."""

from __future__ import annotations

import pytest

from kvtier.bench.timing import Rounds, alternate, spread


def test_path_and_baseline_alternate_and_flip_order_each_round() -> None:
    ran: list[str] = []
    rounds = alternate({"base": lambda: ran.append("B"), "path": lambda: ran.append("A")}, 3)
    # One untimed warm-up round, then B A | A B | B A: each pair back to back.
    assert "".join(ran) == "BA" + "BA" + "AB" + "BA"
    assert len(rounds.seconds["base"]) == len(rounds.seconds["path"]) == 3


def test_the_ratio_is_the_median_of_the_pairs_not_of_the_bests() -> None:
    # Pair 1 hit by a burst on both sides: its ratio still holds; best-of would pair the
    # path's best (round 1) with the baseline's best (round 0): 2.0 / 1.0, not the 0.5 of
    # every pair.
    rounds = Rounds({"path": [2.0, 8.0, 2.2], "base": [1.0, 4.0, 1.1]})
    s = rounds.ratio("path", "base")
    assert (s.median, s.low, s.high, s.pairs) == (0.5, 0.5, 0.5, 3)
    assert rounds.median("path") == 2.2 and rounds.gbps("path", 22) == pytest.approx(1e-8)


def test_a_baseline_of_several_names_counts_each_rounds_fastest() -> None:
    rounds = Rounds({"path": [2.0, 2.0, 2.0], "one": [1.0, 3.0, 4.0], "two": [2.0, 1.0, 0.5]})
    assert rounds.per_round(["one", "two"]) == [1.0, 1.0, 0.5]
    assert rounds.ratio("path", ["one", "two"]).fields("r") == {
        "r": 0.5,
        "r_min": 0.25,
        "r_max": 0.5,
    }


def test_unpaired_runs_are_refused() -> None:
    with pytest.raises(ValueError, match="pairs"):
        spread([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="repeats"):
        alternate({"a": lambda: None}, 0)
