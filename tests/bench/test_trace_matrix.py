"""``python -m kvtier.bench.trace_matrix``: the figures of one point, kept in the cache under
a key that names the trace and the code, read back instead of replayed, and the margin the
issue's bar reads (REUSE minus the better of LRU and ARC)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.bench import trace_matrix


def test_a_point_is_replayed_once_and_then_read_from_the_cache(tmp_path: Path) -> None:
    first = trace_matrix.matrix(["few-shot"], [0.05], ["REUSE"], tmp_path)
    files = sorted(tmp_path.iterdir())
    assert len(files) == 1 + len(trace_matrix.REFERENCES)
    stamps = [f.stat().st_mtime_ns for f in files]
    again = trace_matrix.matrix(["few-shot"], [0.05], ["REUSE"], tmp_path)
    assert again == first and [f.stat().st_mtime_ns for f in files] == stamps
    (row,) = first["rows"]
    assert row["REUSE_margin"] == pytest.approx(row["REUSE"] - max(row["lru"], row["arc"]))
    assert first["least_margin"]["REUSE"] == row["REUSE_margin"]
    assert row["REUSE"] <= row["opt"] and row["lru"] <= row["opt"]


def test_the_table_names_every_point_and_an_unknown_policy_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--traces", "few-shot", "--capacities", "0.05", "--cache", str(tmp_path)]
    assert trace_matrix.main(args) == 0
    out = capsys.readouterr().out
    assert "| few-shot | 5% |" in out and "least margin: REUSE" in out
    with pytest.raises(SystemExit):
        trace_matrix.main([*args, "--policies", "FIFO"])
    assert "FIFO" in capsys.readouterr().err


def test_another_seed_is_another_trace_with_figures_of_its_own(tmp_path: Path) -> None:
    default = trace_matrix.matrix(["few-shot"], [0.05], ["REUSE"], tmp_path)
    drawn = trace_matrix.matrix(["few-shot"], [0.05], ["REUSE"], tmp_path, seed=7)
    assert len(list(tmp_path.iterdir())) == 2 * (1 + len(trace_matrix.REFERENCES))
    assert drawn["rows"][0]["opt"] != default["rows"][0]["opt"]
    again = trace_matrix.matrix(["few-shot"], [0.05], ["REUSE"], tmp_path, seed=7)
    assert again == drawn
