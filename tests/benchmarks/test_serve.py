"""``python -m benchmarks serve`` in pieces (a full run starts 10+ vLLM servers: not a test):
its arguments, the chat workload, vLLM's parser accepting the benchmark's arguments, and the
counters of a pass. Its configurations: test_serve_plans.py; its figures: test_serve_figures.py."""

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


def test_save_decode_cache_is_the_configs_unless_given() -> None:
    assert parsed("--no-save-decode-cache").save_decode_cache is False
    assert parsed().save_decode_cache is None  # the config's default


def test_repeats_must_be_one_or_more() -> None:
    with pytest.raises(ValueError, match="--repeats is 0; use 1 or more"):
        serve.run(parsed("--repeats", "0"))
