"""A bench that found a problem (wrong outputs, leaked state) prints its figures, names each
problem on stderr and exits non-zero (kvtier.cli.bench.run), so a script or CI sees it."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from kvtier.cli import bench


def run_with(result: dict[str, Any]) -> int:
    args = argparse.Namespace(json=True, _bench=lambda _: result)
    return bench.run(args)


def test_a_bench_without_problems_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_with({"ratio": 0.9, "problems": []}) == 0
    assert run_with({"ratio": 0.9}) == 0
    assert capsys.readouterr().err == ""


def test_each_problem_is_named_and_the_bench_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_with({"ratio": 0.9, "problems": ["a: outputs differ", "b: leaked"]}) == 1
    captured = capsys.readouterr()
    assert '"ratio": 0.9' in captured.out  # the figures still come out
    assert "kvtier: error: a: outputs differ" in captured.err
    assert "kvtier: error: b: leaked" in captured.err
