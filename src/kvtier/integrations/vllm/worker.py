"""The worker side of the connector (runs in each vLLM worker process): it owns the cache.

The worker opens a :class:`~kvtier.service.Service`: its cache (``service.cache``) is an
engine in this process (with the admin API and the decoder's PD receiver its config asks
for; ``service.local_engine``), or, with ``kv_connector_extra_config: {"server":
"unix:///path/kvtier.sock"}``, a client of the host's ``kvtier server`` (one cache shared by
every vLLM instance on the host, outliving them). With a server, a lookup's pins and a load's
lease live in the server, keyed by (this worker's connection, vLLM request id), and end by
the same ``end`` path; a worker that dies releases them all when its socket closes.

Lifecycle::

    register(kv_caches)   read the paged layout, open the cache, open the lookup channel
    load(meta)            kvtier pages -> the request's vLLM blocks: CPU hits before the
                          forward, disk/Redis hits on the loader thread (:mod:`.loads`)
    save(meta)            after the forward: whole new chunks of prompts -> kvtier (not for
                          a request whose load this step came up short: its forward used
                          unfilled blocks, and vLLM recomputes it)
    failed_blocks()       blocks a load could not fill (a chunk that failed its checksum or
                          vanished from a lower tier): vLLM recomputes them
    close()               channel closed, loads drained, cache closed (ends every lease)

Who touches the cache: the lookup channel's threads (lookup, end, stats), vLLM's model
thread (sync loads, saves) and the loader thread (async loads). The Engine is thread-safe;
what must not interleave is an ``end`` with a load of the same request, which the cache
orders itself (``cache.loading(rid)``: an end during a load releases when it is done).

One request, one registry: the lease in the cache (the Engine's, or the server's) holds the
request's pins, the plan its lookup pinned and the prompt's keys, so the prompt is hashed
once, by the lookup; loads reuse the plan, saves and events reuse the keys.

The lookup answers two numbers: the hit, and how much of it is in the CPU tier (the cache's
:class:`~kvtier.hit.Hit`, sent to the scheduler as it is: the rest comes from disk or Redis
and is loaded asynchronously), the same through a server.
What needs the Engine itself (eviction events, ``leaks``, ``clear``, PD, counters for vLLM's
/metrics) is the server's business then: its admin API and /metrics.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Any

import torch

from kvtier.admin.server import AdminServer
from kvtier.cache import CacheIdentity, KVCache
from kvtier.config import Config
from kvtier.cpu_affinity import engine_cpus, unpinned, use_cpus
from kvtier.engine import Engine
from kvtier.errors import ConfigError, StateError
from kvtier.integrations.vllm.copy_buffer import ModelThreadBuffers
from kvtier.integrations.vllm.events import EventLog
from kvtier.integrations.vllm.groups import ModelGroups
from kvtier.integrations.vllm.layerwise import LayerLoads
from kvtier.integrations.vllm.loads import Loads, scratch_tokens
from kvtier.integrations.vllm.metadata import KVTierMetadata
from kvtier.integrations.vllm.metrics import CounterDeltas
from kvtier.integrations.vllm.one_copy import OneCopy
from kvtier.integrations.vllm.paged import PagedKV
from kvtier.integrations.vllm.pd import DecoderPulls, PDEndpoint
from kvtier.integrations.vllm.rpc import LookupServer
from kvtier.integrations.vllm.save_drain import SaveDrain
from kvtier.integrations.vllm.shutdown import ShutdownTally, server_line
from kvtier.integrations.vllm.states import PagedState, with_states
from kvtier.integrations.vllm.worker_channel import WorkerChannel
from kvtier.integrations.vllm.worker_saves import WorkerSaves
from kvtier.layout import KVLayout
from kvtier.memory.device import CopyEngine, DeviceCopies
from kvtier.server.client import ServerClient
from kvtier.service import Service
from kvtier.storage.cpu import CpuTier

log = logging.getLogger(__name__)


class WorkerSide:
    def __init__(
        self,
        config: Config,
        *,
        model_name: str,
        engine_id: str,
        tp_rank: int,
        tp_world_size: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        events: bool = False,
        server: str | None = None,
        groups: ModelGroups | None = None,
        copies: CopyEngine | None = None,
        one_copy: bool | None = None,
    ) -> None:
        """``copies``: the owner of every copy between vLLM's memory and kvtier's pages
        (:class:`DeviceCopies` by default; a test passes one whose copies land late). A save
        whose copies may land late runs its store behind the step (:mod:`.save_drain`).
        ``one_copy``: the kernel between vLLM's blocks and kvtier's pages, no scratch
        (:mod:`.one_copy`): None where it can run on CUDA, True also on CPU tensors (tests,
        under ``TRITON_INTERPRET=1``), False never."""
        if server is not None and config.enable_pd:
            raise ConfigError(
                "server", server, "no server with enable_pd (PD runs in the worker's own Engine)"
            )
        self.config = config
        self.server = server
        self.model_name = model_name
        self.engine_id = engine_id
        self.tp_rank = tp_rank
        self.tp_world_size = tp_world_size
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        # vLLM's KV-cache groups; one of a kind kvtier does not model turns kvtier off.
        self.groups = groups or ModelGroups(())
        self.off = self.groups.off
        self.service: Service | None = None  # the cache, its admin API and PD receiver
        self.cache: KVCache | None = None  # service.cache: what loads, saves and lookups use
        self.engine: Engine | None = None  # service.local_engine: in-process, else None
        self.paged: PagedKV | None = None
        self.states: PagedState | None = None  # the state groups' blocks, if any
        # The grain of checkpoints a lookup probes inside a missed chunk (0: none).
        self.checkpoint_unit = self.groups.checkpoint_unit(config.chunk_size, block_size)
        self._server: LookupServer | None = None
        self._loads: Loads | None = None
        self._layers: LayerLoads | None = None  # use_layerwise: the step's sync loads
        self._buffers: ModelThreadBuffers | None = None  # the model thread's (copy_buffer.py)
        self._finished_saves: set[str] = set()  # ended requests to report (finished_saves)
        self.copies = copies if copies is not None else DeviceCopies()
        self.one_copy_mode = one_copy
        self._one_copy: OneCopy | None = None
        self._drain: SaveDrain | None = None  # stores behind the step (save_drain.py)
        self._saves: WorkerSaves | None = None  # the save path (worker_saves.py), once open
        # Only rank 0 reports events: every rank stores the same chunks (its own slice).
        self.events = EventLog(block_size, config.chunk_size) if events and tp_rank == 0 else None
        self._media: list[str] = []
        self._pd: PDEndpoint | None = None
        self.pulls: DecoderPulls | None = None  # a PD decoder's pulls (xPyD)
        self._deltas = CounterDeltas()

    # -- lifecycle -------------------------------------------------------------------------
    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        if self.off:
            # The scheduler side warned once and asks nothing: no cache, no channel.
            why = ", ".join(self.groups.unsupported) or self.groups.refusal
            log.info("kvtier worker %d: off (%s)", self.tp_rank, why)
            return
        state_names = set(self.groups.state_layer_names())
        attention = self.groups.for_paged()
        paged = PagedKV.from_vllm(
            {n: t for n, t in kv_caches.items() if n not in state_names},
            block_size=self.block_size,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            mla=self.groups.mla,
            groups=attention if len(attention) > 1 else (),
        )
        layout = paged.layout()
        if self.groups.state:
            layout, self.states = with_states(
                kv_caches, layout, self.groups, self.config.chunk_size, self.block_size
            )
        # Every thread kvtier starts here (PD, lookups, loads, writes) runs on the CPUs vLLM
        # was given, not only the compute cores it pinned this thread to (kvtier.cpu_affinity).
        use_cpus(engine_cpus())
        with unpinned():
            self._open(paged, layout)

    def _open(self, paged: PagedKV, layout: KVLayout) -> None:
        """Open the cache (this worker's own, or its client of the host's server), the loads,
        the PD roles and the scheduler's channel."""
        cfg = self.config
        identity = CacheIdentity(
            model_name=self.model_name, tp_rank=self.tp_rank, tp_world_size=self.tp_world_size
        )
        client: KVCache
        if self.server:  # the host's kvtier server holds the cache; this is its client
            client = ServerClient(self.server, layout, config=cfg, copies=self.copies, **identity)
        else:
            client = Engine(cfg, layout, copies=self.copies, **identity)
        service = Service(cfg, layout, cache=client, **identity).open()
        paged, self._one_copy = OneCopy.build(
            service.local_engine, paged, states=self.states is not None, force=self.one_copy_mode
        )
        self.service, self.paged, self.cache = service, paged, service.cache
        device = paged.layers[0].device
        self._drain = SaveDrain(layout, cfg.chunk_size, device).open()
        cache = service.cache
        self._buffers = buffers = ModelThreadBuffers(cache.layout, cfg.chunk_size, device)
        self._loads = Loads(
            cache,
            paged,
            self.block_size,
            self.states,
            self._attention_tables,
            self.copies,
            self._one_copy,
        )
        if cfg.use_layerwise and LayerLoads.serves(paged, self._loads):  # else whole chunks
            self._layers = LayerLoads(self._loads, paged, self.copies)
        engine = service.local_engine  # in-process, with its admin API and receiver
        if engine is not None:
            self.engine = engine
            published = [(t, t.medium) for t in engine.tiers() if t.medium is not None]
            self._media = [medium for _, medium in published]
            if self.events is not None:
                for tier, medium in published:
                    self.events.follow(tier, medium)
            if engine.config.enable_pd and engine.config.pd_role == "sender":
                self._pd = PDEndpoint(engine, self.tp_rank)
            self.pulls = DecoderPulls.for_service(engine, service)  # a PD decoder's, or None
        else:
            # The server evicts on its own; stores are reported in the media it has.
            # A server not reached yet has at least its CPU tier.
            media = cache.stats().get("tier_media", {})
            cpu = CpuTier.medium
            self._media = list(media.values()) or ([cpu] if cpu is not None else [])
        self._saves = WorkerSaves(
            cache,
            paged,
            self._loads,
            self._drain,
            late=self.copies.on_device(paged.layers[0]),
            scratch_for=buffers.scratch_rows,
            attention_tables=self._attention_tables,
            states=self.states,
            events=self.events,
            engine=self.engine,
            pd=self._pd,
            media=self._media,
            one_copy=self._one_copy,
            copies=self.copies,  # use_layerwise: saves layer by layer (layerwise_saves.py)
        )
        self._server = LookupServer(self.engine_id, self.tp_rank, WorkerChannel(self)).open()
        log.info(
            "kvtier worker %d: %s%s, cache %s, channel %s, threads on CPUs %s",
            self.tp_rank,
            paged.describe(),
            f"; {self.states.describe()}" if self.states is not None else "",
            self.server or "in-process",
            self._server.path,
            sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else "any",
        )

    @property
    def admin(self) -> AdminServer | None:
        """The admin API of the cache this worker owns (its Service's), or None."""
        return self.service.admin if self.service is not None else None

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._pd is not None:
            self._pd.close()
            self._pd = None
        if self.pulls is not None:
            self.pulls.close()
            self.pulls = None
        if self._drain is not None:
            self._drain.close()  # every save queued lands and is stored before the cache closes
        if self._loads is not None:
            self._loads.close()
        if self.service is not None:
            # One line says what the close flushed, dropped and saved (shutdown.py).
            tally = ShutdownTally.of(self.engine) if self.engine is not None else None
            started = time.monotonic()
            self.service.close()  # its receiver and admin API, then its cache
            if tally is not None:
                log.info("%s", tally.line(self.tp_rank, time.monotonic() - started))
            elif self.server:
                log.info("%s", server_line(self.tp_rank, self.server))

    # -- the step --------------------------------------------------------------------------
    def load(self, meta: KVTierMetadata) -> None:
        """Start the step's loads: async ones on the loader thread; CPU-tier ones now, whole
        (before the forward), or layer by layer with ``use_layerwise`` (:mod:`.layerwise`:
        each lands in its layer's :meth:`wait_layer`)."""
        if self.off or not meta.loads:
            return  # kvtier is off for this model, or a decode step: nothing to load
        loads, buffers = self._loads_part(), self._buffers_part()
        layers, chunk = self._layers, self.config.chunk_size
        sync = []
        for spec in meta.loads:
            if spec.async_load:
                loads.submit(spec)
            elif layers is not None:
                sync.append(spec)
            elif loads.one_copy is not None:  # the kernel straight from the pages
                loads.run(spec)
            elif loads.staged:  # KV on a device: a window of a few chunks, never the prompt
                staging = buffers.staging.rows(scratch_tokens(spec, chunk))
                loads.run(spec, staging, buffers.scratch.rows(loads.window_tokens))
            else:
                loads.run(spec, buffers.scratch.rows(scratch_tokens(spec, chunk)))
        if layers is not None:
            layers.begin(sync)

    def wait_layer(self, layer_name: str) -> None:
        """Before ``layer_name`` computes (vLLM's ``wait_for_layer_load``)."""
        if self._layers is not None:
            self._layers.wait(layer_name)

    def layers_done(self) -> None:
        """The forward is over: a layer-wise load that missed a layer is a miss (before
        this step's saves and load errors are read)."""
        if self._layers is not None:
            self._layers.finish()

    def save_layer(self, layer_name: str, meta: KVTierMetadata) -> None:
        """After ``layer_name`` computed (vLLM's ``save_kv_layer``; :mod:`.layerwise_saves`)."""
        if self._saves is not None:
            self._saves.save_layer(layer_name, meta)

    def save(self, meta: KVTierMetadata) -> None:
        """Gather this step's saves out of vLLM's blocks and store them (:mod:`.worker_saves`:
        behind the step where the copies may land late, else before this returns)."""
        # Reported once this step's saves landed, whatever becomes of them (finished_saves):
        # vLLM holds the blocks of an ended request until then, and nothing may hold them
        # longer.
        self._finished_saves.update(meta.finishing)
        if not meta.saves or self.off:
            return
        if self._saves is None:
            raise StateError("kvtier worker: vLLM has not registered its KV caches yet")
        self._saves.save(meta)

    def failed_blocks(self) -> set[int]:
        if self.off:
            return set()
        return self._loads.failed_blocks() if self._loads is not None else set()

    def failed_requests(self, done: set[str]) -> set[str]:
        """Of the finished loads ``done``, those that failed (several KV-cache groups)."""
        return self._loads.failed_requests(done) if self._loads is not None else set()

    def finished_saves(self) -> set[str]:
        """Ended requests (``finishing``) with no save left copying out of their blocks
        (vLLM's finished_sending; each reported once): vLLM frees their blocks then."""
        saves = self._saves
        done = {r for r in self._finished_saves if saves is None or not saves.saving(r)}
        self._finished_saves -= done
        return done

    def finished_loads(self) -> set[str]:
        """Requests whose async load is done (vLLM's finished_recving)."""
        return self._loads.finished() if self._loads is not None else set()

    def take_events(self) -> list[tuple[Any, ...]]:
        return self.events.drain() if self.events is not None else []

    def counter_deltas(self) -> dict[str, int]:
        """The Engine's counters' increase since the last call (for vLLM's /metrics; through a
        server, its own /metrics counts for every instance)."""
        if self.engine is None:
            return {}
        return self._deltas.take_from(self.engine.counters)

    def short_loads(self) -> dict[str, int]:
        """Requests whose load this step came up short (called once per step, after save)."""
        return self._loads.short_loads() if self._loads is not None else {}

    # -- helpers ---------------------------------------------------------------------------
    def _attention_tables(self, tables: Any) -> Any:
        """The block tables :class:`PagedKV` addresses: without the state groups' tables."""
        if not self.groups.state or not tables or isinstance(tables[0], int):
            return tables
        picked = [tables[i] for i in self.groups.attention_indexes]
        return picked[0] if len(picked) == 1 else tuple(picked)

    def _loads_part(self) -> Loads:
        if self._loads is None:
            raise StateError("kvtier worker: vLLM has not registered its KV caches yet")
        return self._loads

    def _buffers_part(self) -> ModelThreadBuffers:
        if self._buffers is None:
            raise StateError("kvtier worker: vLLM has not registered its KV caches yet")
        return self._buffers

    def _parts(self) -> tuple[KVCache, PagedKV]:
        if self.cache is None or self.paged is None:
            raise StateError("kvtier worker: vLLM has not registered its KV caches yet")
        return self.cache, self.paged

    @property
    def scratch_tokens(self) -> int:
        """Token rows (all layers) of the model thread's copy buffer and the layer-wise
        loads' slots (0 before the first save or load): on a GPU, memory this worker holds
        outside vLLM's budget (:mod:`.copy_buffer`, :mod:`.layerwise`)."""
        held = 0 if self._buffers is None else self._buffers.scratch.tokens
        held += self._drain.tokens if self._drain is not None else 0  # saves behind the step
        held += self._loads.scratch_tokens if self._loads is not None else 0  # loader thread's
        return held + (self._layers.scratch_tokens if self._layers is not None else 0)

    def stats(self) -> dict[str, int]:
        """This worker's own figures (the probe's ``stats()["worker"]``)."""
        layers, tokens = self._layers, self.scratch_tokens
        # The copy buffers are chunk tensors of the cache's layout (copy_buffer.py).
        per_token = self.cache.layout.token_bytes() if self.cache is not None else 0
        return {
            "scratch_tokens": tokens,
            "scratch_bytes": tokens * per_token,
            "one_copy": int(self._one_copy is not None),  # the kernel on kvtier's pages
            "layerwise_loads": layers.loads if layers is not None else 0,
            "layerwise_failures": layers.failures if layers is not None else 0,
            **(self._saves.stats() if self._saves is not None else {}),  # layer-wise saves
        }
