"""kvtier loading MLA latents into vLLM's blocks, on any host: the worker side with real
paged tensors shaped as vLLM's MLA backends give them ([blocks, 1, block, 576]: one latent per
token and layer), a real Engine and the scheduler's real lookup channel, without vLLM's
processes. (vLLM itself prefills on a cached MLA prefix only where its AMX backend runs, so
test_model_families.py can serve an MLA hit only there; this is the load path everywhere.)"""

from __future__ import annotations

import uuid
from types import SimpleNamespace

import pytest
import torch

from kvtier.config import Config
from kvtier.integrations.vllm.groups import ModelGroups, VllmGroup
from kvtier.integrations.vllm.metadata import KVTierMetadata, LoadSpec, SaveSpec
from kvtier.integrations.vllm.rpc import LookupClient
from kvtier.integrations.vllm.scheduler import SchedulerSide
from kvtier.integrations.vllm.worker import WorkerSide
from kvtier.layout import GroupKind

LATENT, LAYERS, BLOCK, BLOCKS, CHUNK = 576, 3, 16, 32, 32  # kv_lora_rank 512 + rope 64
NAMES = tuple(f"model.layers.{i}.self_attn.attn" for i in range(LAYERS))


def mla_worker(dtype: torch.dtype) -> WorkerSide:
    chunk_bytes = CHUNK * LAYERS * LATENT * dtype.itemsize  # planes 1: no separate K and V
    side = WorkerSide(
        Config.load(
            overrides={"chunk_size": CHUNK, "max_local_cpu_size": f"{8 * chunk_bytes}B"}, env={}
        ),
        model_name="tiny-mla",
        engine_id=f"test-mla-{uuid.uuid4().hex}",
        tp_rank=0,
        tp_world_size=1,
        block_size=BLOCK,
        num_kv_heads=1,
        head_dim=LATENT,
        events=False,
        groups=ModelGroups((VllmGroup(GroupKind.MLA, 0, NAMES, "MLAAttentionSpec", BLOCK),)),
    )
    side.register({n: torch.zeros(BLOCKS, 1, BLOCK, LATENT, dtype=dtype) for n in NAMES})
    return side


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mla_latents_saved_from_blocks_load_into_other_blocks_exactly(dtype: torch.dtype) -> None:
    worker = mla_worker(dtype)
    scheduler = SchedulerSide(
        [LookupClient(worker.engine_id)], block_size=BLOCK, chunk_size=CHUNK, loads=True, saves=True
    )
    try:
        assert worker.paged is not None and worker.engine is not None
        layout = worker.paged.layout()
        assert (layout.planes, layout.hidden, layout.tp_shared) == (1, LATENT, True)
        gen = torch.Generator().manual_seed(11)
        src, dst = [3, 4, 5, 6, 7], [20, 21, 22, 23, 24]
        for layer in worker.paged.layers:
            layer[src] = torch.randn(len(src), 1, BLOCK, LATENT, generator=gen).to(dtype)
        tokens = list(range(300, 380))  # 80 tokens: 2 whole chunks + 16
        worker.save(KVTierMetadata(saves=[SaveSpec("w", tokens[:64], src, 0, 64)]))
        stats = worker.engine.stats()
        assert stats["stored_chunks"] == 2
        assert stats["tiers"]["cpu"]["used_bytes"] == 2 * CHUNK * LAYERS * LATENT * dtype.itemsize

        request = SimpleNamespace(request_id="r", prompt_token_ids=tokens)
        assert scheduler.num_new_matched_tokens(request, 16) == (64 - 16, False)
        scheduler.after_alloc(request, dst, 48)
        step = SimpleNamespace(
            preempted_req_ids=set(),
            scheduled_new_reqs=[
                SimpleNamespace(
                    req_id="r", prompt_token_ids=tokens, block_ids=(dst,), num_computed_tokens=16
                )
            ],
            num_scheduled_tokens={"r": 16},
            scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
        )
        meta = scheduler.build_meta(step)
        assert meta.loads == [LoadSpec("r", tokens, dst, 16, 64)]
        worker.load(meta)
        for layer in worker.paged.layers:
            assert torch.equal(layer[dst[1:4]], layer[src[1:4]])  # tokens 16..63, bit for bit
            assert not layer[dst[0]].any() and not layer[dst[4]].any()  # vLLM's own, untouched
        assert worker.failed_blocks() == set() and worker.short_loads() == {}
        scheduler.finished("r")
        assert worker.engine.leaks() == [] and worker.engine.check_invariants() == []
    finally:
        scheduler.close()
        worker.close()
