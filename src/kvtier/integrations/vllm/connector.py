"""``KVTierConnector``: vLLM's KV connector API mapped onto the two sides.

vLLM builds one instance per role: ``SCHEDULER`` in the engine-core process, ``WORKER`` in each
worker process. Each instance holds only its side (:class:`SchedulerSide` or
:class:`WorkerSide`); a call for the other side is a programming error of vLLM's, not ours.

Config: ``Config.load()`` (``KVTIER_CONFIG_FILE`` / ``LMCACHE_CONFIG_FILE`` / ``KVTIER_*``
env), then ``kv_connector_extra_config`` on top (keys as in the YAML; a ``kvtier.`` prefix is
accepted and dropped). Both processes load the same config, so they agree on the chunk size.

Hybrid models: the connector implements ``SupportsHMA``, so vLLM keeps its hybrid KV cache
manager on (sliding-window layers keep only their window; Mamba / gated delta-net hybrids
start at all). Block ids then come per KV-cache group (:mod:`.groups`); a model with a group
kvtier does not model runs with kvtier off (one warning), never a failed start; so does a
speculative setup whose draft keeps KV kvtier does not store (:mod:`.speculative`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.outputs import KVConnectorOutput

from kvtier.errors import StateError
from kvtier.integrations.vllm.events import to_vllm
from kvtier.integrations.vllm.groups import classify
from kvtier.integrations.vllm.metadata import KVTierMetadata, KVTierWorkerMetadata
from kvtier.integrations.vllm.metrics import KVTierPromMetrics, KVTierStats
from kvtier.integrations.vllm.scheduler import SchedulerSide
from kvtier.integrations.vllm.sides import (
    ROLES,
    fit_to_vllm,
    load_config,
    quiet_config_warnings,
    scheduler_side,
    worker_side,
)
from kvtier.integrations.vllm.worker import WorkerSide
from kvtier.observability.logs import join_host_logging

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


class KVTierConnector(KVConnectorBase_V1, SupportsHMA):
    """kvtier as a vLLM v1 KV connector (prefix cache across CPU, disk and Redis)."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        join_host_logging("vllm")  # kvtier's lines in vLLM's format, at KVTIER_LOG_LEVEL
        transfer = self._kv_transfer_config
        kv_role = transfer.kv_role or "kv_both"
        if kv_role not in ROLES:
            raise StateError(f"kv_role {kv_role!r} is not supported; use {', '.join(ROLES)}")
        scheduler = role == KVConnectorRole.SCHEDULER
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        events_config = vllm_config.kv_events_config
        self._events_on = bool(events_config and events_config.enable_kv_cache_events)
        self._events: list[tuple[Any, ...]] = []
        fitted = fit_to_vllm(vllm_config, classify(kv_cache_config), scheduler=scheduler)
        self.config, self._off = fitted.config, fitted.groups.off
        if scheduler:
            self._scheduler = scheduler_side(vllm_config, fitted, kv_role)
        else:
            self._worker = worker_side(vllm_config, fitted, events=self._events_on)

    # -- worker side -----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker_side().register(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        # Whole chunks (the default): a CPU-tier load is queued before the forward starts,
        # and the forward's stream waits for its copies (kvtier.memory.device). Layer-wise
        # (use_layerwise): the chunks land in host staging and layer 0's copy is queued;
        # each layer follows in wait_for_layer_load (.layerwise). Disk and Redis loads start
        # here and finish in the background (get_finished).
        self._worker_side().load(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Layer-wise: this layer's copy has landed in vLLM's blocks (or its requests are
        # misses) and the next layer's is queued. Whole chunks: nothing to wait for.
        self._worker_side().wait_layer(layer_name)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Layer-wise loads run Python between layers, which a full CUDA graph would skip
        on replay: vLLM then captures piecewise graphs. Whole-chunk loads allow full ones."""
        with quiet_config_warnings():
            return load_config(extra_config).use_layerwise

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(ended requests vLLM kept whose saves all landed, the requests whose async load
        from disk/Redis is done)."""
        worker = self._worker_side()
        sent, done = worker.finished_saves(), worker.finished_loads()
        return sent or None, done or None

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        # Layer-wise (use_layerwise): this layer's part of the step's saves is gathered out
        # of its blocks and, on a GPU, queued to host memory on kvtier's store stream; it
        # returns without waiting (.layerwise_saves). Whole chunks: saved in wait_for_save.
        if self.has_connector_metadata():
            self._worker_side().save_layer(layer_name, self._meta())

    def wait_for_save(self) -> None:
        # The blocks are gathered now, in the model's stream order; on a GPU the copies into
        # kvtier's pages are queued and land behind the step (save_drain.py): vLLM keeps an
        # ended request's blocks until get_finished reports it (request_finished delays the
        # free). On a CPU host they have landed before this returns. Layer-wise, the layers
        # were copied in save_kv_layer: here the step's stores go behind it (or are skipped
        # whole if a layer was never copied).
        self._worker_side().layers_done()  # a layer-wise load that missed a layer: a miss
        if self.has_connector_metadata():
            self._worker_side().save(self._meta())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Finished async loads, and (several KV-cache groups) the failed ones by request:
        vLLM cannot map block ids back to requests when groups share ids."""
        worker = self._worker_side()
        done = worker.finished_loads()
        failed = worker.failed_requests(done)
        return KVConnectorTransferResults(
            finished_sending=worker.finished_saves(), finished_recving=done, failed_recving=failed
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker_side().failed_blocks()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        worker = self._worker_side()
        short, events = worker.short_loads(), worker.take_events()
        return KVTierWorkerMetadata(short, events) if short or events else None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        # vLLM asks both sides (the scheduler merges its own stats in); only workers count.
        if self._worker is None:
            return None
        deltas = self._worker.counter_deltas()
        return KVTierStats(dict(deltas)) if deltas else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return KVTierStats(dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        return KVTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # A save in flight copies from its own buffer, gathered from the blocks in the model's
        # stream order before wait_for_save returned: no copy reads a preempted request's
        # blocks after that.
        return

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()

    # -- scheduler side --------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self._off:
            return 0, False
        return self._scheduler_side().num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if self._off:
            return
        tables = blocks.get_block_ids() if blocks is not None else ([],)
        self._scheduler_side().after_alloc(request, tables[0], num_external_tokens, tables)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self._off:
            return KVTierMetadata()
        return self._scheduler_side().build_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, KVTierWorkerMetadata):
            self._scheduler_side().short_loads(meta.short_loads)
            if self._events_on:
                self._events.extend(meta.events)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """kvtier's stores and evictions (medium CPU, DISK, REMOTE) for vLLM's publisher."""
        events, self._events = self._events, []
        return to_vllm(events)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """(keep the blocks until get_finished names the request: a save of it may still be
        copying, the PD prefiller's answer for the decode request or None)."""
        return self._finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's one end-of-request call with the hybrid manager on (every group's blocks):
        the lease ends once, exactly as in :meth:`request_finished`."""
        return self._finished(request, block_ids)

    def reset_cache(self) -> bool | None:
        """vLLM's reset of the external prefix cache (``reset_prefix_cache(reset_connector=
        True)``): every tier drops its unpinned entries."""
        if self._off:
            return True
        return self._scheduler_side().reset()

    # -- helpers ---------------------------------------------------------------------------
    def _finished(
        self, request: Request, tables: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self._off:
            return False, None
        side = self._scheduler_side()
        delay = side.save_output(request, tables)  # reads the request's state: first
        return delay, side.finished(request.request_id, request.kv_transfer_params)

    def _meta(self) -> KVTierMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierMetadata)
        return meta

    def _worker_side(self) -> WorkerSide:
        if self._worker is None:
            raise StateError("a worker-side KV connector call reached the scheduler side")
        return self._worker

    def _scheduler_side(self) -> SchedulerSide:
        if self._scheduler is None:
            raise StateError("a scheduler-side KV connector call reached a worker")
        return self._scheduler
