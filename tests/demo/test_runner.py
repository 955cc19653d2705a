"""A tiny run of the demo: every configuration gives the same tokens, kvtier hits, plot exists."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.cli.main import main
from kvtier.demo.plot import write_plot
from kvtier.demo.report import format_table
from kvtier.demo.runner import Options, disk_tier_available, run_demo
from kvtier.demo.tiny_models import build_model
from kvtier.demo.workload import Workload, conversations, schedule

TINY = Workload(
    users=2, rounds=3, system_tokens=40, context_tokens=70, question_tokens=9, answer_tokens=5
)


def test_demo_runner_same_tokens_with_hits(tmp_path: Path) -> None:
    opts = Options(workload=TINY, model_size="tiny", chunk_size=16, progress=False)
    result = run_demo(opts)
    names = [run.name for run in result.configs]
    assert names == (
        ["no-cache", "cpu", "restart"] if disk_tier_available() else ["no-cache", "cpu"]
    )
    assert result.mismatches() == []
    assert result.problems() == []
    for run in result.configs:
        assert len(run.records) == TINY.requests
        assert all(len(r.tokens) == TINY.answer_tokens for r in run.records)
    assert result.configs[0].hit_rate() == 0
    cpu = result.configs[1]
    assert cpu.hit_rate() > 0.3 and cpu.tier_bytes["cpu"] > 0
    # Later rounds reuse at least the previous round's prompt, up to its last full chunk.
    assert all(r.reused_tokens >= 16 * ((40 + 70) // 16) for r in cpu.records if r.round > 0)
    if disk_tier_available():
        restart = result.configs[2]
        assert restart.hit_tokens_by_tier.get("disk", 0) > 0
        first_round = [r for r in restart.records if r.round == 0]
        assert all(r.reused_tokens >= 96 for r in first_round)  # warm from disk after restart
    table = format_table(result)
    assert "TTFT p50" in table and "no kvtier" in table
    plot = tmp_path / "demo.png"
    write_plot(result, str(plot))
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_mismatch_is_reported() -> None:
    opts = Options(
        workload=Workload(
            users=1,
            rounds=1,
            system_tokens=20,
            context_tokens=20,
            question_tokens=4,
            answer_tokens=3,
        ),
        model_size="tiny",
        chunk_size=16,
        progress=False,
    )
    result = run_demo(opts)
    run = result.configs[1]
    rec = run.records[0]
    run.records[0] = type(rec)(
        rec.round,
        rec.user,
        rec.prompt_tokens,
        rec.hit_tokens,
        rec.reused_tokens,
        rec.ttft_s,
        (*rec.tokens[:-1], rec.tokens[-1] + 1),
    )
    assert result.mismatches() == ["cpu: round 1, user 1"]


def test_workload_histories_grow_by_answer_and_question() -> None:
    convs = conversations(TINY)
    assert convs[0].history[:40] == convs[1].history[:40]  # shared system prompt
    assert convs[0].history[40:] != convs[1].history[40:]
    first = convs[0].prompt(0)
    convs[0].answer(0, [1, 2, 3, 4, 5])
    second = convs[0].prompt(1)
    assert second[: len(first)] == first and len(second) == len(first) + 5 + 9
    assert schedule(TINY)[:3] == [(0, 0), (0, 1), (1, 0)]


def test_cli_demo_on_a_local_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Any local Hugging Face checkpoint of a supported family, loaded without network access.
    build_model("qwen2", "tiny", seed=3).save_pretrained(tmp_path / "ckpt")
    plot = tmp_path / "out.png"
    argv = ["demo", "--model-dir", str(tmp_path / "ckpt"), "--users", "2", "--rounds", "2"]
    argv += ["--system-tokens", "32", "--context-tokens", "40", "--chunk-size", "16"]
    argv += ["--answer-tokens", "4", "--no-progress", "--plot", str(plot)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "tokens: identical in every configuration" in out and "speedup" in out
    assert f"local:{tmp_path / 'ckpt'}" in out
    assert plot.exists()


def test_cli_demo_refuses_a_missing_checkpoint(tmp_path: Path) -> None:
    argv = ["demo", "--model-dir", str(tmp_path / "nothing"), "--no-progress"]
    assert main([*argv, "--plot", str(tmp_path / "p.png")]) == 2  # a clear error, no traceback
