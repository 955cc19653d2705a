"""What the worker-side tests share: a registered WorkerSide over real paged tensors, and the
steps vLLM's scheduler would send it (tests/integrations/vllm/test_worker_*.py)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvtier.config import Config
from kvtier.integrations.vllm.groups import ModelGroups
from kvtier.integrations.vllm.rpc import LookupClient
from kvtier.integrations.vllm.scheduler import SchedulerSide
from kvtier.integrations.vllm.worker import WorkerSide
from kvtier.memory.device import CopyEngine

LAYERS, HEADS, DIM, BLOCK, BLOCKS, CHUNK = 2, 2, 8, 16, 64, 32
CHUNK_BYTES = 2 * LAYERS * CHUNK * HEADS * DIM * 4


def kv_caches() -> dict[str, torch.Tensor]:
    return {
        f"model.layers.{i}.attn": torch.zeros(BLOCKS, HEADS, BLOCK, 2 * DIM) for i in range(LAYERS)
    }


@pytest.fixture
def worker() -> Iterator[WorkerSide]:
    side = make_worker()
    yield side
    side.close()


def make_worker(
    *,
    model_name: str = "tiny",
    groups: ModelGroups | None = None,
    server: str | None = None,
    copies: CopyEngine | None = None,
    **overrides: object,
) -> WorkerSide:
    """A registered worker with events on; ``groups``: vLLM's KV-cache groups (None: one);
    ``server``: the kvtier server it is a client of (None: an Engine of its own);
    ``copies``: its copy engine (a late one makes its KV "device")."""
    values = {"chunk_size": CHUNK, "max_local_cpu_size": f"{8 * CHUNK_BYTES}B", **overrides}
    side = WorkerSide(
        Config.load(overrides=values, env={}),
        model_name=model_name,
        engine_id=f"test-{uuid.uuid4().hex}",
        tp_rank=0,
        tp_world_size=1,
        block_size=BLOCK,
        num_kv_heads=HEADS,
        head_dim=DIM,
        events=True,
        groups=groups,
        server=server,
        copies=copies,
    )
    side.register(kv_caches())
    return side


def fill(worker: WorkerSide, blocks: list[int], seed: int) -> None:
    assert worker.paged is not None
    gen = torch.Generator().manual_seed(seed)
    for layer in worker.paged.layers:
        layer[blocks] = torch.randn(len(blocks), HEADS, BLOCK, 2 * DIM, generator=gen)


def image_request(rid: str, tokens: list[int], image: str | None) -> SimpleNamespace:
    """A request as vLLM's scheduler gives it, with ``image`` over tokens [40, 50)."""
    position = SimpleNamespace(offset=40, length=10)
    features = [] if image is None else [SimpleNamespace(identifier=image, mm_position=position)]
    return SimpleNamespace(
        request_id=rid,
        prompt_token_ids=tokens,
        cache_salt=None,
        lora_request=None,
        mm_features=features,
        prompt_embeds=None,
    )


def first_step(rid: str, tokens: list[int], blocks: list[int]) -> SimpleNamespace:
    """vLLM's SchedulerOutput for the step that computes all of a new request's prompt."""
    new = SimpleNamespace(
        req_id=rid, prompt_token_ids=tokens, block_ids=(blocks,), num_computed_tokens=0
    )
    return SimpleNamespace(
        preempted_req_ids=set(),
        scheduled_new_reqs=[new],
        num_scheduled_tokens={rid: len(tokens)},
        scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
    )


def step_of_new(rid: str, tokens: list[int], blocks: list[int], scheduled: int) -> SimpleNamespace:
    """vLLM's SchedulerOutput for one new request prefilling ``scheduled`` tokens."""
    return SimpleNamespace(
        preempted_req_ids=set(),
        scheduled_new_reqs=[
            SimpleNamespace(
                req_id=rid, prompt_token_ids=tokens, block_ids=(blocks,), num_computed_tokens=0
            )
        ],
        num_scheduled_tokens={rid: scheduled},
        scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
    )


IDLE_STEP = SimpleNamespace(
    preempted_req_ids=set(),
    scheduled_new_reqs=[],
    scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
)


IDLE_STEP = SimpleNamespace(
    preempted_req_ids=set(),
    scheduled_new_reqs=[],
    scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
)


def scheduler_for(worker: WorkerSide, **options: Any) -> SchedulerSide:
    """A scheduler side that loads and saves through ``worker``'s lookup channel, as vLLM's
    engine core runs one (``options``: the scheduler's others, e.g. ``all_async``)."""
    return SchedulerSide(
        [LookupClient(worker.engine_id)],
        block_size=BLOCK,
        chunk_size=CHUNK,
        loads=True,
        saves=True,
        **options,
    )
