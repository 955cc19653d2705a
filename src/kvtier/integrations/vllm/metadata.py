"""What the scheduler side tells the workers each step (vLLM's connector metadata).

Positions are token indices of the request; blocks are the request's whole block table for
vLLM's first KV cache group (a position ``p`` lives in ``block_ids[p // block_size]``)::

    LoadSpec   tokens [start, end) go from kvtier into the request's blocks.
               start: what vLLM already holds (its own prefix cache, whole blocks);
               end:   the kvtier hit vLLM accepted (whole blocks, < len(prompt)).
               async_load: some of it is on disk or in Redis, so it loads in the
               background while the request waits (vLLM's asynchronous external load).
    SaveSpec   tokens [start, end) go from the blocks into kvtier: whole chunks of the
               prompt that this step finished computing and kvtier does not hold; or, for
               a request that ended (``finishing``), whole chunks of prompt + output.
               from_cache: a state model's PD prefiller's hit [start, end), which kvtier holds
               and vLLM's blocks keep no state for: sent from kvtier's copy, not stored.

Both carry the prompt's tokens (a load: the whole prompt, which is what the lookup hashed, so
the worker reuses the pinned plan; a save: the prompt up to ``end``) and the request's salt:
vLLM's ``cache_salt``, or :class:`~kvtier.request_salt.ExtraKeys` with its LoRA adapter, images and
prompt embeddings too (:mod:`.extra_keys`), which key every chunk of the request. The
metadata is pickled to the worker processes, so it holds plain Python values only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvtier.request_salt import RequestSalt

# PD: keys of vLLM's per-request kv_transfer_params (the hand-off is drawn in .pd).
TRANSFER_ID = "kvtier_transfer_id"  # kvtier's own: the prefiller's id for the transfer
DO_REMOTE_DECODE = "do_remote_decode"  # the standard proxies' prefill request: true
DO_REMOTE_PREFILL = "do_remote_prefill"  # the prefiller's answer, for the decode request


@dataclass(frozen=True, slots=True)
class LoadSpec:
    request_id: str
    tokens: list[int]
    block_ids: list[int]
    start: int
    end: int
    async_load: bool = False  # from disk/Redis: in the background, reported when done
    cache_salt: RequestSalt | None = None  # the request's own salt: part of every key it uses
    # Several KV-cache groups (vLLM's hybrid manager): every group's table, in group order
    # (``block_ids`` is the first); empty with one group.
    group_block_ids: tuple[list[int], ...] = ()

    @property
    def tables(self) -> tuple[list[int], ...] | list[int]:
        """What :class:`~kvtier.integrations.vllm.paged.PagedKV` addresses with."""
        return self.group_block_ids or self.block_ids


@dataclass(frozen=True, slots=True)
class SaveSpec:
    request_id: str
    tokens: list[int]
    block_ids: list[int]
    start: int
    end: int
    transfer_id: str | None = None  # a prefiller's request: also send [start, end) (.pd)
    cache_salt: RequestSalt | None = None
    group_block_ids: tuple[list[int], ...] = ()  # as in LoadSpec
    from_cache: bool = False  # send [start, end) from kvtier's copy (the module docstring)

    @property
    def tables(self) -> tuple[list[int], ...] | list[int]:
        return self.group_block_ids or self.block_ids


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    # Ended requests whose blocks vLLM keeps until this step's saves are copied: each worker
    # reports them as finished_sending after its saves of the step, stored or not.
    finishing: list[str] = field(default_factory=list)


@dataclass
class KVTierWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler after a step.

    ``short_loads``: requests whose load came up short, with the tokens that did arrive; the
    scheduler saves those chunks again once vLLM recomputes them (the tier dropped the bad
    copy). With several workers the shortest load counts.
    ``events``: kvtier's stores and evictions since the last step (:mod:`.events`).
    """

    short_loads: dict[str, int] = field(default_factory=dict)
    events: list[tuple[Any, ...]] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVTierWorkerMetadata)
        merged = dict(self.short_loads)
        for rid, loaded in other.short_loads.items():
            merged[rid] = min(loaded, merged.get(rid, loaded))
        return KVTierWorkerMetadata(merged, self.events + other.events)
