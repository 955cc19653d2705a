"""``python -m benchmarks ttft`` on a tiny model: every field is there and the arithmetic holds."""

from __future__ import annotations

import json

import pytest
from benchmarks.__main__ import main


def test_bench_ttft_json_fields(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["ttft", "--json", "--model-size", "tiny", "--prompt-tokens", "320"]
    assert main([*argv, "--chunk-size", "32", "--repeats", "1"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["cached_50_tokens"] == 160 and result["cached_90_tokens"] == 288
    for f in (50, 90):
        assert result[f"ttft_cached_{f}_ms"] > 0 and result[f"ttft_ideal_{f}_ms"] > 0
        speedup = result["ttft_full_ms"] / result[f"ttft_cached_{f}_ms"]
        # The bench rounds each figure to 3 decimals: within 1 % or that rounding, whichever is
        # more (a figure far below 1, on a loaded machine, is mostly rounding).
        assert result[f"speedup_{f}"] == pytest.approx(speedup, rel=1e-2, abs=5e-4)
        ratio = result[f"speedup_{f}"] / result[f"ideal_speedup_{f}"]
        assert result[f"efficiency_{f}"] == pytest.approx(ratio, rel=1e-2, abs=5e-4)


def test_bench_ttft_layerwise_on_the_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["ttft", "--json", "--model-size", "tiny", "--prompt-tokens", "320", "--repeats", "1"]
    assert main([*argv, "--chunk-size", "32", "--layerwise", "on", "--fractions", "90"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["layerwise"] == "on" and result["device"] == "cpu"
    assert result["cached_90_tokens"] == 288 and "cached_50_tokens" not in result
    assert result["layerwise_scratch_bytes"] == 0  # a CPU model reads the host staging itself
    assert 0 < result["load_90_ms"] < result["ttft_cached_90_ms"]
    ratio = result["speedup_90"] / result["ideal_speedup_90"]
    assert result["efficiency_90"] == pytest.approx(ratio, rel=1e-2, abs=5e-4)


def test_bench_ttft_help_names_device_layerwise_and_the_8b_shape(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["ttft", "--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--device", "--layerwise", "--fractions", "8b"):
        assert flag in text


def test_the_8b_entry_has_llama_3_8b_shape() -> None:
    import torch
    from benchmarks.ttft import model_config

    from kvtier.integrations.hf_kv import layout_from_model

    config = model_config("8b", 32768)
    layout = layout_from_model(config, torch.bfloat16)
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (32, 8, 128)
    assert (config.hidden_size, config.num_attention_heads) == (4096, 32)
    assert config.intermediate_size == 14336 and config.max_position_embeddings >= 32768
    assert layout.chunk_bytes(1) == 128 * 1024  # 128 KiB of bf16 KV per token


def test_bench_ttft_refuses_cuda_without_a_gpu() -> None:
    import torch

    from kvtier.errors import StateError

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    with pytest.raises(StateError, match="no CUDA"):
        main(["ttft", "--model-size", "tiny", "--device", "cuda", "--prompt-tokens", "64"])


@pytest.mark.parametrize(
    ("bad", "why"), [("0", "in 1..99"), ("50,x", "percentages like"), ("100", "in 1..99")]
)
def test_bench_ttft_refuses_bad_fractions(
    capsys: pytest.CaptureFixture[str], bad: str, why: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["ttft", "--fractions", bad])
    assert exited.value.code == 2
    assert why in capsys.readouterr().err
