"""``kvtier bench serve`` in pieces (a full run starts 10+ vLLM servers: minutes, not a test):
each configuration's vLLM settings, the chat workload, vLLM's parser accepting the
benchmark's arguments, and the headline ratios."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvtier.bench import serve
from kvtier.cli.bench import BENCHMARKS
from kvtier.testing.checkpoint import words_for


def parsed(*extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(list(extra))


def test_each_configuration_starts_vllm_as_documented(tmp_path: Path) -> None:
    plans = {
        name: serve.plan_for(name, tmp_path, "1GiB", "redis://127.0.0.1:1", "/tmp/s.sock")
        for name in serve.CONFIGS
    }
    assert plans["none"].transfer is None and not plans["none"].prefix_cache
    assert plans["apc"].transfer is None and plans["apc"].prefix_cache
    for name in ("cpu", "disk", "redis", "server", "example"):
        assert not plans[name].prefix_cache  # reuse is the connector's alone
        assert plans[name].transfer is not None
    extra = {n: p.transfer["kv_connector_extra_config"] for n, p in plans.items() if p.transfer}
    assert extra["cpu"] == {"max_local_cpu_size": "1GiB"}
    assert extra["disk"]["local_cpu"] is False and extra["disk"]["local_disk"].endswith("disk")
    assert extra["redis"]["remote_url"] == "redis://127.0.0.1:1"
    assert extra["server"] == {"server": "unix:///tmp/s.sock"}
    assert plans["example"].transfer["kv_connector"] == "ExampleConnector"  # type: ignore[index]
    assert {n for n, p in plans.items() if p.fresh} == {"disk", "redis", "server"}
    with pytest.raises(ValueError, match="unknown"):
        serve.plan_for("gpu", tmp_path, "1GiB")


def test_chat_history_grows_round_by_round_from_a_shared_start() -> None:
    prompts = serve.chat_prompts(3, 4, 10, 5, 7, vocab=1024)
    assert len(prompts) == 12
    words = [p.split() for p in prompts]
    for i, prompt in enumerate(words):
        assert prompt[:10] == words[0][:10]  # every user shares the system part
        if i >= 3:  # the same user's previous round is a prefix of this one
            assert prompt[: len(words[i - 3])] == words[i - 3]
            assert len(prompt) == len(words[i - 3]) + 12
    assert words_for([3, 4]) == "w0 w1"


def test_vllm_accepts_the_benchmark_arguments_for_both_workloads(tmp_path: Path) -> None:
    args = parsed("--shape", "tiny", "--users", "2", "--rounds", "2", "--system-words", "8")
    datasets = serve.datasets_for(args, tmp_path)
    assert set(datasets) == {"prefix", "chat"}
    lines = (tmp_path / "chat.jsonl").read_text().splitlines()
    assert len(lines) == 4 and json.loads(lines[0])["output_tokens"] == 16
    for dataset in datasets.values():
        ns = serve.benchmark_arguments("http://127.0.0.1:1", tmp_path, args, dataset)
        assert ns.base_url == "http://127.0.0.1:1" and ns.temperature == 0
        assert ns.ignore_eos and ns.model == serve.SERVED_NAME
    assert "serve" in BENCHMARKS


def test_headline_ratios_from_a_table() -> None:
    def row(ttft: float, throughput: float) -> dict[str, float]:
        return {"mean_ttft_ms": ttft, "output_throughput": throughput}

    table = {
        "none": {"pass1": row(1000, 100), "pass2": row(1000, 100)},
        "apc": {"pass1": row(1000, 100), "pass2": row(100, 150)},
        "cpu": {"pass1": row(1000, 95), "pass2": row(190, 140)},
        "server": {"pass1": row(1000, 90), "pass2": row(280, 130)},
        "example": {"pass1": row(1000, 80), "pass2": row(500, 120)},
    }
    texts = {"none": ["a", "b"], "cpu": ["a", "b"], "example": ["a", "c"]}
    out = serve.top_level(table, texts)
    assert out["ttft_efficiency_cpu"] == 0.9
    assert out["ttft_efficiency_server"] == 0.8
    assert out["ttft_efficiency_example"] == round(500 / 900, 3)
    assert out["server_vs_inprocess"] == round(0.8 / 0.9, 3)
    assert out["e2e_throughput_vs_example"] == round(95 / 80, 3)
    assert out["e2e_throughput_vs_none"] == 0.95
    assert out["outputs_equal_cpu"] == 1.0 and out["outputs_equal_example"] == 0.5
    assert "ttft_efficiency_disk" not in out  # not measured: not reported
