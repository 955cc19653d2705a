"""The server's engines: one per fingerprint, made on the first Hello that names it.

A fingerprint (model, layout, chunk size, hash, tensor-parallel rank, engine-wide salt) gets its
own :class:`~kvtier.service.Service` (an Engine and its admin API) whose CPU page buffer is
a memfd its clients map. Two fingerprints never share a page or a chunk; they do share the
disk directory and the Redis server, where every file and record is named by its fingerprint
already. An engine outlives
the clients that filled it by ``server_model_idle_secs`` (300 s): when its last client has
been gone that long, its CPU tier and shared memory are released (its disk tier stays, and
the next client of that model finds it warm). With
``internal_api_server_enabled`` each engine has its admin API, dashboard and Prometheus
``/metrics`` (token as everywhere: ``admin_token``), one port per model, derived from its
fingerprint so that it survives a server restart (:mod:`~kvtier.server.admin_ports`).

Sizing: each engine gets ``max_local_cpu_size``; unset, a tenth of the machine's memory (the
smaller of physical memory and the cgroup's ``memory.max``), at most the 5 GiB default, so a
server started with no config fits a small host (logged at start). Less when
``server_salt_quota`` is set and the engine-wide salt (the connection's ``cache_salt``;
no salt too)
already holds part of its quota in other engines. ``server_max_memory`` bounds all engines
together: a new engine that does not fit first releases idle engines (the longest idle
first); if it still does not fit, or it would leave less than one chunk for the salt, or
take the server past the machine's memory, it is refused
(:class:`~kvtier.errors.CapacityError` / :class:`~kvtier.errors.ConfigError`, sent as
``Refused`` with that sentence): its client sees misses, the others are served.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace

from kvtier.admin.server import AdminServer
from kvtier.cache import CacheIdentity, fingerprint_for
from kvtier.config import Config
from kvtier.engine import Engine
from kvtier.errors import CapacityError, ConfigError, ProtocolError, StateError
from kvtier.host_memory import machine_memory
from kvtier.layout import KVLayout, dtype_from_name, parse_groups
from kvtier.p2p.node import P2PNode
from kvtier.server.admin_ports import model_admin_port
from kvtier.server.protocol import Hello
from kvtier.server.shared_memory import SharedPages
from kvtier.service import Service
from kvtier.storage.base import Tier
from kvtier.tiers import build_lower_tiers
from kvtier.validation import check_fits_in_memory

log = logging.getLogger(__name__)

DEFAULT_CPU_SHARE = 10  # unset max_local_cpu_size: 1/10 of the machine's memory per model


def model_cpu_bytes(config: Config) -> int:
    """Each model's CPU tier: ``max_local_cpu_size`` when a source set it, else a tenth of
    :func:`machine_memory`, at most the 5 GiB default (logged)."""
    default = Config.__dataclass_fields__["max_local_cpu_size"].default
    if "max_local_cpu_size" in config.origin or config.max_local_cpu_size != default:
        return config.max_local_cpu_size
    memory = machine_memory()
    if memory is None:
        return config.max_local_cpu_size
    share = min(config.max_local_cpu_size, memory // DEFAULT_CPU_SHARE)
    log.info(
        "max_local_cpu_size unset: each model's CPU tier is %d bytes, a tenth of this "
        "machine's %d bytes of memory (at most %d); set max_local_cpu_size to choose",
        share,
        memory,
        config.max_local_cpu_size,
    )
    return share


def identity_of(hello: Hello) -> CacheIdentity:
    """The cache identity a client's hello names (its fingerprint is recomputed from it)."""
    return CacheIdentity(
        model_name=hello.model_name, tp_rank=hello.tp_rank, tp_world_size=hello.tp_world_size
    )


@dataclass
class ModelSlot:
    fingerprint: str  # hex
    salt: str  # the connection's engine-wide cache_salt (not a request's tenant)
    service: Service  # the model's engine and its admin API, opened and closed together
    memory: SharedPages
    clients: int = 0  # connections served by this engine now
    idle_since: float | None = None  # monotonic time its last client left

    @property
    def engine(self) -> Engine:
        return self.service.engine

    @property
    def admin(self) -> AdminServer | None:
        return self.service.admin

    @property
    def admin_url(self) -> str | None:
        return self.service.admin_url

    @property
    def pin_budget(self) -> int:
        """Pages one connection may hold pinned (``server_client_pin_share``, at least 1)."""
        share = self.engine.config.server_client_pin_share
        return max(1, int(self.engine.num_pages * share))

    @property
    def cpu_bytes(self) -> int:
        return self.engine.num_pages * self.engine.chunk_bytes


class ModelTable:
    def __init__(self, config: Config, p2p: P2PNode | None = None) -> None:
        """``p2p``: the server's P2P node (``p2p_listen``): each engine reads its peers'
        chunks through a p2p tier, last in its search order, and announces its CPU tier's."""
        self.config = config
        self.p2p = p2p
        self.cpu_bytes_per_model = model_cpu_bytes(config)
        self._slots: dict[str, ModelSlot] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._wake = threading.Event()
        self._reaper: threading.Thread | None = None
        self.released = 0  # idle engines released

    def slot_for(self, hello: Hello) -> ModelSlot:
        """The open engine for the client's fingerprint, made on first use. Raises a
        :class:`~kvtier.errors.KVTierError` saying why the client cannot be served.

        The fingerprint is recomputed here from the fields the client sent, every time: a
        client that claims another model's fingerprint gets a mismatch, never its pages."""
        layout = KVLayout(
            hello.num_layers,
            hello.num_kv_heads,
            hello.head_dim,
            dtype_from_name(hello.dtype),
            planes=hello.planes,
            groups=parse_groups(hello.groups),
        )
        config = self.config.with_overrides(
            chunk_size=hello.chunk_size,
            pre_caching_hash_algorithm=hello.hash_algorithm,
            cache_salt=hello.cache_salt,
            save_unfull_chunk=hello.save_unfull_chunk,
            enable_pd=False,  # a PD decoder runs its own engine; the server is a cache
        )
        fingerprint = fingerprint_for(config, layout, **identity_of(hello)).hex()
        if fingerprint != hello.fingerprint:
            raise ProtocolError(
                f"fingerprint mismatch: the client computed {hello.fingerprint}, the server "
                f"{fingerprint} from the same fields (different kvtier versions?)"
            )
        with self._lock:
            if self._closed:
                raise StateError("the server is shutting down")
            slot = self._slots.get(fingerprint)
            if slot is None:
                slot = self._slots[fingerprint] = self._make(hello, layout, config)
                self._start_reaper()
            elif slot.engine.config.save_unfull_chunk != hello.save_unfull_chunk:
                raise ConfigError(
                    "save_unfull_chunk",
                    hello.save_unfull_chunk,
                    f"{slot.engine.config.save_unfull_chunk}, as the clients already serving "
                    "this model set it",
                )
            slot.clients += 1
            slot.idle_since = None
            return slot

    def release(self, slot: ModelSlot) -> None:
        """A client of ``slot`` left; the engine is released once idle long enough."""
        with self._lock:
            slot.clients -= 1
            if slot.clients <= 0:
                slot.clients = 0
                slot.idle_since = time.monotonic()
        self._wake.set()

    def _make(self, hello: Hello, layout: KVLayout, config: Config) -> ModelSlot:
        config = replace(
            config,
            max_local_cpu_size=self._cpu_budget(hello, layout),
            internal_api_server_port_start=model_admin_port(
                config.internal_api_server_port_start, hello.fingerprint
            ),
        )
        self._make_room(config.max_local_cpu_size, layout.chunk_bytes(hello.chunk_size))
        memory = SharedPages(f"kvtier-{hello.fingerprint[:16]}")
        lower: list[Tier] | None = None
        if self.p2p is not None:
            # The config's own lower tiers, then the peers: a local disk read is cheaper.
            fp = fingerprint_for(config, layout, **identity_of(hello))
            lower = [*build_lower_tiers(config, layout, fp), self.p2p.tier(fp.hex(), layout)]
        try:
            # The Service opens the engine, then its admin API, dashboard and /metrics
            # (internal_api_server_enabled): one port per model, derived from its
            # fingerprint (admin_ports.py). No PD receiver: enable_pd is off here.
            service = Service(
                config,
                layout,
                **identity_of(hello),
                page_memory=memory.make,
                lower_tiers=lower,
            )
            engine = service.engine
            total = sum(s.cpu_bytes for s in self._slots.values())
            check_fits_in_memory(
                "max_local_cpu_size", total + engine.num_pages * engine.chunk_bytes
            )
            service.open()
            if self.p2p is not None:
                cpu = engine.tier("cpu")
                assert cpu is not None
                self.p2p.attach(hello.fingerprint, cpu, layout, engine.chunk_bytes)
        except BaseException:
            memory.close()
            raise
        slot = ModelSlot(hello.fingerprint, hello.cache_salt, service, memory)
        log.info(
            "model %r (fingerprint %s, salt %r): %d pages of %d bytes in shared memory%s",
            hello.model_name,
            hello.fingerprint[:16],
            hello.cache_salt,
            engine.num_pages,
            engine.chunk_bytes,
            f", admin API {slot.admin_url}" if slot.admin_url else "",
        )
        return slot

    def _cpu_budget(self, hello: Hello, layout: KVLayout) -> int:
        wanted = self.cpu_bytes_per_model
        quota = self.config.server_salt_quota
        if quota is None:
            return wanted
        held = sum(s.cpu_bytes for s in self._slots.values() if s.salt == hello.cache_salt)
        budget = min(wanted, quota - held)
        chunk = layout.chunk_bytes(hello.chunk_size)
        if budget < chunk:
            raise ConfigError(
                "server_salt_quota",
                quota,
                f"room for one more chunk ({chunk} bytes) for salt {hello.cache_salt!r}, "
                f"which already holds {held} bytes in other models",
            )
        return budget

    def _make_room(self, wanted: int, chunk: int) -> None:
        """Release idle engines (longest idle first) until ``wanted`` bytes fit within
        ``server_max_memory``; :class:`CapacityError` if they cannot. Under the lock."""
        limit = self.config.server_max_memory
        if limit is None:
            return
        need = wanted // chunk * chunk  # what the engine will allocate: whole pages
        idle = sorted(
            (s for s in self._slots.values() if s.clients == 0 and s.idle_since is not None),
            key=lambda s: s.idle_since or 0.0,
        )
        while sum(s.cpu_bytes for s in self._slots.values()) + need > limit and idle:
            victim = idle.pop(0)
            del self._slots[victim.fingerprint]
            self._close_slot(victim, "to make room for a new model")
        held = sum(s.cpu_bytes for s in self._slots.values())
        if held + need > limit:
            raise CapacityError(
                f"server_max_memory is {limit} bytes; {len(self._slots)} models in use hold "
                f"{held} and this model needs {need} (max_local_cpu_size): not served until "
                f"a model goes idle, or raise server_max_memory"
            )

    def _start_reaper(self) -> None:
        if self._reaper is None:
            self._reaper = threading.Thread(
                target=self._reap, name="kvtier-idle-models", daemon=True
            )
            self._reaper.start()

    def _reap(self) -> None:
        grace = self.config.server_model_idle_secs
        while True:
            self._wake.wait(min(1.0, grace / 4))
            self._wake.clear()
            now = time.monotonic()
            # Closed under the lock: a Hello for the same model waits for the old engine to
            # drain its disk writes, so two engines never share its disk files at once.
            with self._lock:
                if self._closed:
                    return
                expired = [
                    s
                    for s in self._slots.values()
                    if s.clients == 0 and s.idle_since is not None and now - s.idle_since >= grace
                ]
                for slot in expired:
                    del self._slots[slot.fingerprint]
                    self._close_slot(slot, f"no client for {grace:g} s")

    def _close_slot(self, slot: ModelSlot, why: str) -> None:
        self.released += 1
        if self.p2p is not None:
            self.p2p.detach(slot.fingerprint)  # announced gone before its pages are
        log.info(
            "releasing model %s (%d bytes of CPU tier; its disk tier stays): %s",
            slot.fingerprint[:16],
            slot.cpu_bytes,
            why,
        )
        try:
            slot.service.close()  # its admin API, then its engine
        except Exception as exc:  # one engine failing to close must not skip the others
            log.error("closing model %s: %s", slot.fingerprint[:16], exc)
        finally:
            slot.memory.close()

    def slots(self) -> list[ModelSlot]:
        with self._lock:
            return list(self._slots.values())

    def close(self) -> None:
        """Close every engine (each drains its in-flight disk/Redis writes first)."""
        with self._lock:
            self._closed = True
            slots, self._slots = list(self._slots.values()), {}
        self._wake.set()
        for slot in slots:
            self._close_slot(slot, "the server is stopping")
        self.released -= len(slots)  # counted as shutdown, not as idle releases
