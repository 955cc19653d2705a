"""``python -m benchmarks replicas``: its workload, ideal and verdicts (fast), and the bench
itself in a small form (slow: four vLLM replicas, vLLM alone and on one ``kvtier server``)."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
from benchmarks.fleet import ideal_tokens

from benchmarks import replicas


def args(*extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    replicas.add_arguments(parser)
    return parser.parse_args(list(extra))


def test_round_robin_sends_every_repeat_of_a_prefix_to_the_other_replica() -> None:
    a = args("--prefix-tokens", "512", "--suffix-tokens", "8", "--prefixes", "3", "--repeats", "3")
    prompts = replicas.workload(a, seed=1)
    assert len(prompts) == 9 and {len(p) for p in prompts} == {520}
    for i, prompt in enumerate(prompts):
        same = [j for j, other in enumerate(prompts) if other[:512] == prompt[:512]]
        assert same == [i % 3, i % 3 + 3, i % 3 + 6]
        # request j goes to replica j % 2 under round-robin: repeats alternate replicas
        assert [j % 2 for j in same] in ([0, 1, 0], [1, 0, 1])
    assert len({tuple(p[512:]) for p in prompts}) == 9  # every question is fresh
    # each prefix computed once, each question once: the floor every policy is held to
    assert ideal_tokens(prompts) == 3 * 512 + 9 * 8
    assert replicas.workload(a, seed=1) == prompts != replicas.workload(a, seed=2)


@pytest.mark.parametrize(
    "extra",
    [("--prefix-tokens", "1000"), ("--prefix-tokens", "4096"), ("--configs", "plain,nfs")],
    ids=["partial-chunk", "past-context", "unknown-config"],
)
def test_arguments_the_bench_cannot_measure_are_refused(extra: tuple[str, ...]) -> None:
    with pytest.raises(SystemExit, match="replicas"):
        replicas.check_arguments(args(*extra))


def _row(config: str, policy: str, ratio: float, equal: bool | None = True) -> dict[str, Any]:
    return {"config": config, "policy": policy, "computed_over_ideal": ratio,
            "outputs_equal_plain": equal}  # fmt: skip


def _ttft(config: str, other: float, kvtier: float, ratio: float) -> dict[str, Any]:
    return {"config": config, "ttft_other_ms": other, "ttft_kvtier_ms": kvtier,
            "other_over_local_hit": ratio}  # fmt: skip


def test_the_server_meets_the_target_only_with_every_policy_and_the_ttft_and_outputs() -> None:
    rows = [_row("plain", "round_robin", 1.9), _row("server", "round_robin", 1.02),
            _row("server", "kv_aware", 1.0)]  # fmt: skip
    ttft = [_ttft("plain", 300.0, 280.0, 3.0), _ttft("cpu", 290.0, 100.0, 2.9),
            _ttft("server", 105.0, 100.0, 1.05)]  # fmt: skip
    got = replicas.summary(rows, ttft)
    assert got["server_computed_over_ideal_max"] == 1.02
    assert got["server_other_over_cpu_local_hit"] == 1.05
    assert got["plain_other_over_server_other"] == round(300 / 105, 3)
    assert got["target_met"]
    assert not replicas.summary(rows + [_row("server", "cache_aware", 1.06)], ttft)["target_met"]
    assert not replicas.summary(rows, ttft[:2] + [_ttft("server", 120, 100, 1.2)])["target_met"]
    wrong = rows + [_row("server", "cache_aware", 1.0, equal=False)]
    assert not replicas.summary(wrong, ttft)["target_met"]
    wrong_ttft = ttft[:2] + [{**_ttft("server", 105.0, 100.0, 1.05), "outputs_equal_plain": False}]
    assert not replicas.summary(rows, wrong_ttft)["target_met"]


def test_outputs_are_compared_prompt_by_prompt_with_vllm_alone() -> None:
    texts = {"plain": {"rr/0": "a b", "rr/1": "c"}, "server": {"rr/0": "a b", "rr/1": "d"}}
    assert replicas._compare_outputs(texts) == {"plain": [], "server": ["rr/1"]}
    assert replicas._compare_outputs({"server": texts["server"]}) == {}


@pytest.mark.slow
@pytest.mark.timeout(900, func_only=True)  # four vLLM starts: ~2.5 min quiet, 6+ under load
def test_two_replicas_on_one_server_compute_each_prefix_once_and_answer_as_vllm_alone() -> None:
    """The bench, small: vLLM alone and the server configuration, round-robin (the policy
    that sends each repeat to the replica that never saw its prefix), one TTFT round."""
    small = args(
        "--configs", "plain,server", "--policies", "round_robin", "--prefix-tokens", "1024",
        "--prefixes", "1", "--repeats", "2", "--ttft-prefixes", "1", "--output-tokens", "4",
    )  # fmt: skip
    result = replicas.run(small)
    assert result["problems"] == []
    rows = {r["config"]: r for r in result["rows"]}
    ideal = 1024 + 2 * 64
    # vLLM alone: the second replica computes the prefix again
    assert rows["plain"]["ideal_tokens"] == ideal
    assert rows["plain"]["prefill_tokens"] == 2 * 1024 + 2 * 64
    # one server: the second replica loads it (each prompt's whole chunks), computes its question
    assert rows["server"]["prefill_tokens"] == ideal, rows["server"]
    assert rows["server"]["kvtier_hit_tokens"] == 1024
    assert rows["server"]["computed_over_ideal"] <= replicas.COMPUTED_OVER_IDEAL_MAX
    assert all(r["outputs_equal_plain"] for r in result["rows"] + result["ttft"])
    ttft = {t["config"]: t for t in result["ttft"]}
    # the directed round measured what it says: the other replica and the local hit both
    # loaded the prefix from the server; with vLLM alone the other replica computed it
    assert ttft["server"]["sources"]["other"]["external_kv_transfer"] == 1024
    assert ttft["server"]["sources"]["kvtier"]["external_kv_transfer"] == 1024
    assert ttft["server"]["sources"]["device"]["local_cache_hit"] == 1024
    assert ttft["plain"]["sources"]["other"]["local_compute"] == 1024 + 64
