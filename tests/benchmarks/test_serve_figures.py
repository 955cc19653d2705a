"""The figures of ``python -m benchmarks serve`` (benchmarks.serve_figures): the headline
ratios, the passes that measured something else, medians over rounds, and completions that
differ from vLLM alone's."""

from __future__ import annotations

from benchmarks.serve_figures import merge_rounds, per_round, problems, top_level, unequal_outputs


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
    out = top_level(table, texts)
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
    out = top_level(table, texts, decode)  # throughput from the hit-free workload
    assert out["e2e_throughput_vs_example"] == 1.2 and out["e2e_throughput_vs_none"] == 0.6
    # the conversation workload compares pass 1 (its later rounds reuse the earlier ones)
    first = {c: {"pass1": passes["pass1"]} for c, passes in table.items()}
    first["apc"]["pass1"] = row(400, 100)
    assert top_level(first, {}, measured="pass1")["ttft_vs_apc_cpu"] == 2.5
    del first["none"]  # a run of apc and cpu only still compares them
    alone = top_level(first, {}, measured="pass1")
    assert alone["ttft_vs_apc_cpu"] == 2.5 and "ttft_efficiency_cpu" not in alone


def test_a_pass_that_measured_something_else_is_named() -> None:
    def row(**counters: object) -> dict[str, object]:
        return {"mean_ttft_ms": 1.0, "failed": 0, **counters}

    good = {
        "none": {"pass2": row(prompt_tokens=100)},
        "apc": {"pass2": row(prompt_tokens=100, vllm_cached_tokens=96)},
        "cpu": {"pass2": row(kvtier_tokens=512, kvtier_tokens_by_tier={"cpu": 512})},
        "server": {"pass2": row(kvtier_tokens=512, kvtier_tokens_by_tier={"cpu": 512})},
    }
    assert problems({"prefix": good}) == []
    bad = {
        "none": {"pass1": row(connector_tokens=16, failed=2)},
        "disk": {"pass2": row(kvtier_tokens=512, kvtier_tokens_by_tier={"disk": 256})},
        "redis": {"pass1": row(), "pass2": row(kvtier_tokens=0)},
        "example": {"pass2": row(vllm_cached_tokens=16)},
    }
    assert problems({"chat": bad}) == [
        "chat/none/pass1: 2 requests failed",
        "chat/none/pass1: a connector served with none configured",
        "chat/disk/pass2: disk served 256 of 512",
        "chat/redis/pass2: kvtier served no token in pass 2",
        "chat/example/pass2: vLLM's prefix cache served with it off",
    ]
    talk = {"cpu": {"pass1": row(kvtier_tokens=0)}}
    assert problems({"conversation": talk}, {"conversation": "pass1"}) == [
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
    merged = merge_rounds(rounds)
    assert merged["cpu"]["pass1"]["output_throughput"] == 100  # the median of 100, 90, 120
    assert merged["example"]["pass1"]["output_throughput"] == 96
    assert merged["none"]["pass1"]["output_throughput"] == 97.5  # over the rounds it ran
    assert merged["cpu"]["pass1"]["by"] == {"cpu": 100}  # not a number: the first round's
    per = per_round([{"decode": r} for r in rounds], "decode")
    assert per["e2e_throughput_vs_example"] == [1.25, 0.9, 1.25]
    assert per["e2e_throughput_vs_none"] == [1.0, round(90 / 95, 3)]


def test_serve_counts_kvtier_outputs_that_differ_in_float32_as_problems() -> None:
    result = {"outputs_equal_cpu": 0.9, "outputs_equal_example": 0.5, "outputs_equal_disk": 1.0}
    found = unequal_outputs(result, "float32")
    assert len(found) == 1 and found[0].startswith("outputs_equal_cpu=0.9")  # a peer's: shown only
    assert unequal_outputs(result, "bfloat16") == []  # compared elsewhere in bf16
