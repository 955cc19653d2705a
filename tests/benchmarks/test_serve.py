"""``python -m benchmarks serve`` in pieces (a full run starts 10+ vLLM servers: not a test):
each configuration's vLLM settings, the chat workload, vLLM's parser accepting the
benchmark's arguments, and the headline ratios."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from benchmarks.__main__ import BENCHMARKS

from benchmarks import serve, serving, workloads
from kvtier.errors import InputError


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
    chunked = serve.plan_for("disk", tmp_path, "1GiB", chunk_size=128).transfer
    assert chunked is not None and chunked["kv_connector_extra_config"]["chunk_size"] == 128
    answers = serve.plan_for("cpu", tmp_path, "1GiB", save_decode_cache=False).transfer
    assert answers is not None
    assert answers["kv_connector_extra_config"]["save_decode_cache"] is False
    assert parsed("--no-save-decode-cache").save_decode_cache is False
    assert parsed().save_decode_cache is None  # the config's default
    for name, key in (("disk", "disk_codec"), ("redis", "remote_codec")):
        coded = serve.plan_for(name, tmp_path, "1GiB", codec="fp8").transfer
        assert coded is not None and coded["kv_connector_extra_config"][key] == "fp8"
    plain = serve.plan_for("cpu", tmp_path, "1GiB", codec="fp8").transfer
    assert plain is not None and "disk_codec" not in plain["kv_connector_extra_config"]


def test_chat_history_grows_round_by_round_from_a_shared_start() -> None:
    entries = workloads.chat_trace(3, 4, 640, 64, 128, output_len=16, block=64)
    assert len(entries) == 12
    ids = [e["hash_ids"] for e in entries]
    for i, entry in enumerate(entries):
        assert ids[i][:10] == ids[0][:10]  # every user shares the system part
        assert entry["input_length"] == 64 * len(ids[i]) and entry["output_length"] == 16
        assert entry["timestamp"] == i  # sent in this order
        if i >= 3:  # the same user's previous round is a prefix of this one, plus 3 blocks
            assert ids[i][: len(ids[i - 3])] == ids[i - 3]
            assert len(ids[i]) == len(ids[i - 3]) + 3
    assert len({tuple(x[10:11]) for x in ids[:3]}) == 3  # users differ after the system part
    with pytest.raises(InputError, match="--answer-tokens is 100; use a multiple"):
        workloads.chat_trace(1, 2, 640, 64, 100, output_len=16, block=64)


def test_vllm_accepts_the_benchmark_arguments_for_every_workload(tmp_path: Path) -> None:
    args = parsed("--shape", "tiny", "--users", "2", "--rounds", "2", "--system-tokens", "128")
    loads = workloads.workloads_for(args, tmp_path)
    assert [w.name for w in loads] == ["prefix", "chat", "decode"]
    assert [w.repeat for w in loads] == [True, True, False]  # decode: hit-free, pass 1 only
    lines = (tmp_path / "chat-trace.jsonl").read_text().splitlines()
    assert len(lines) == 4 and json.loads(lines[0])["output_length"] == 16
    for workload in loads:
        ns = serve.benchmark_arguments("http://127.0.0.1:1", tmp_path, args, workload.dataset)
        assert ns.base_url == "http://127.0.0.1:1" and ns.temperature == 0
        assert ns.ignore_eos and ns.model == serving.SERVED_NAME
        assert ns.max_concurrency == 1 and ns.ready_check_timeout_sec == 0
        assert ns.save_detailed and not ns.save_result  # completions kept, no file written
    assert "serve" in BENCHMARKS
    with pytest.raises(InputError, match="--max-model-len is 4608: vLLM would refuse"):
        workloads.workloads_for(parsed("--max-model-len", "4608"), tmp_path)
    (talk,) = workloads.workloads_for(parsed("--workload", "conversation"), tmp_path)
    assert talk.live and not talk.repeat and talk.measured == "pass1"  # run by kvtier's client
    with pytest.raises(InputError, match="'qa' is unknown"):
        workloads.workloads_for(parsed("--workload", "qa"), tmp_path)


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
    table["none"]["pass2"].update(prompt_tokens=1000, vllm_cached_tokens=0)
    table["cpu"]["pass2"].update(prompt_tokens=1000, connector_tokens=768)
    texts = {"none": ["a", "b"], "cpu": ["a", "b"], "example": ["a", "c"]}
    out = serve.top_level(table, texts)
    assert out["hit_share_none"] == 0 and out["hit_share_cpu"] == 0.768
    assert out["ttft_efficiency_cpu"] == 0.9
    assert out["ttft_vs_apc_cpu"] == 1.9 and out["ttft_vs_apc_server"] == 2.8
    assert out["ttft_efficiency_server"] == 0.8
    assert out["ttft_efficiency_example"] == round(500 / 900, 3)
    assert out["server_vs_inprocess"] == round(0.8 / 0.9, 3)
    assert out["e2e_throughput_vs_example"] == round(95 / 80, 3)
    assert out["e2e_throughput_vs_none"] == 0.95
    assert out["outputs_equal_cpu"] == 1.0 and out["outputs_equal_example"] == 0.5
    assert "ttft_efficiency_disk" not in out  # not measured: not reported
    decode = {"cpu": {"pass1": row(0, 60)}, "example": {"pass1": row(0, 50)}}
    decode["none"] = {"pass1": row(0, 100)}
    out = serve.top_level(table, texts, decode)  # throughput from the hit-free workload
    assert out["e2e_throughput_vs_example"] == 1.2 and out["e2e_throughput_vs_none"] == 0.6
    # the conversation workload compares pass 1 (its later rounds reuse the earlier ones)
    first = {c: {"pass1": passes["pass1"]} for c, passes in table.items()}
    first["apc"]["pass1"] = row(400, 100)
    assert serve.top_level(first, {}, measured="pass1")["ttft_vs_apc_cpu"] == 2.5
    del first["none"]  # a run of apc and cpu only still compares them
    alone = serve.top_level(first, {}, measured="pass1")
    assert alone["ttft_vs_apc_cpu"] == 2.5 and "ttft_efficiency_cpu" not in alone


def test_a_pass_counters_come_from_vllm_metrics_and_kvtier_stats() -> None:
    text = (
        "# HELP vllm:prefix_cache_hits_total Prefix cache hits\n"
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 32.0\n'
        'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 16.0\n'
        'vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 4096.0\n'
        'vllm:prompt_tokens_total{engine="0",model_name="m"} 8448.0\n'
        'vllm:prompt_tokens_created{engine="0",model_name="m"} 1.7e9\n'
    )
    assert serving.parse_metrics(text) == {
        "prompt_tokens": 8448,
        "vllm_cached_tokens": 48,
        "connector_tokens": 4096,
    }
    before = {"prompt_tokens": 100, "kvtier_tokens_by_tier": {"cpu": 256}}
    after = {"prompt_tokens": 400, "kvtier_tokens_by_tier": {"cpu": 768, "disk": 256}}
    assert serving.counter_delta(before, after) == {
        "prompt_tokens": 300,
        "kvtier_tokens_by_tier": {"cpu": 512, "disk": 256},
    }


def test_a_pass_that_measured_something_else_is_named() -> None:
    def row(**counters: object) -> dict[str, object]:
        return {"mean_ttft_ms": 1.0, "failed": 0, **counters}

    good = {
        "none": {"pass2": row(prompt_tokens=100)},
        "apc": {"pass2": row(prompt_tokens=100, vllm_cached_tokens=96)},
        "cpu": {"pass2": row(kvtier_tokens=512, kvtier_tokens_by_tier={"cpu": 512})},
        "server": {"pass2": row(kvtier_tokens=512, kvtier_tokens_by_tier={"cpu": 512})},
    }
    assert serve.problems({"prefix": good}) == []
    bad = {
        "none": {"pass1": row(connector_tokens=16, failed=2)},
        "disk": {"pass2": row(kvtier_tokens=512, kvtier_tokens_by_tier={"disk": 256})},
        "redis": {"pass1": row(), "pass2": row(kvtier_tokens=0)},
        "example": {"pass2": row(vllm_cached_tokens=16)},
    }
    assert serve.problems({"chat": bad}) == [
        "chat/none/pass1: 2 requests failed",
        "chat/none/pass1: a connector served with none configured",
        "chat/disk/pass2: disk served 256 of 512",
        "chat/redis/pass2: kvtier served no token in pass 2",
        "chat/example/pass2: vLLM's prefix cache served with it off",
    ]
    talk = {"cpu": {"pass1": row(kvtier_tokens=0)}}
    assert serve.problems({"conversation": talk}, {"conversation": "pass1"}) == [
        "conversation/cpu/pass1: kvtier served no token in pass 1"
    ]


def test_rounds_merge_into_medians_and_each_round_keeps_its_own_ratio() -> None:
    def row(throughput: float, ttft: float = 0.0) -> dict[str, object]:
        by_tier = {"cpu": int(throughput)}
        return {"output_throughput": throughput, "mean_ttft_ms": ttft, "by": by_tier}

    rounds = [
        {"cpu": {"pass1": row(100)}, "example": {"pass1": row(80)}, "none": {"pass1": row(100)}},
        {"cpu": {"pass1": row(90)}, "example": {"pass1": row(100)}, "none": {"pass1": row(95)}},
        {"cpu": {"pass1": row(120)}, "example": {"pass1": row(96)}},  # none failed here
    ]
    merged = serve.merge_rounds(rounds)
    assert merged["cpu"]["pass1"]["output_throughput"] == 100  # the median of 100, 90, 120
    assert merged["example"]["pass1"]["output_throughput"] == 96
    assert merged["none"]["pass1"]["output_throughput"] == 97.5  # over the rounds it ran
    assert merged["cpu"]["pass1"]["by"] == {"cpu": 100}  # not a number: the first round's
    per = serve.per_round([{"decode": r} for r in rounds], "decode")
    assert per["e2e_throughput_vs_example"] == [1.25, 0.9, 1.25]
    assert per["e2e_throughput_vs_none"] == [1.0, round(90 / 95, 3)]
    with pytest.raises(ValueError, match="--repeats is 0; use 1 or more"):
        serve.run(parsed("--repeats", "0"))
