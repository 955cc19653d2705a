"""The server's engines: one per fingerprint, made on the first Hello that names it.

A fingerprint (model, layout, chunk size, hash, tensor-parallel rank, tenant salt) gets its
own :class:`~kvtier.engine.Engine` whose CPU page buffer is a memfd its clients map. Two
fingerprints never share a page or a chunk; they do share the disk directory and the Redis
server, where every file and record is named by its fingerprint already. An engine lives as
long as the server (the CPU tier outlives the clients that filled it). With
``internal_api_server_enabled`` each engine has its admin API, dashboard and Prometheus
``/metrics`` (token as everywhere: ``admin_token``), one port per model.

Sizing: each engine gets ``max_local_cpu_size``, less when ``server_tenant_quota`` is set and
the tenant (``cache_salt``; the unsalted tenant too) already holds part of its quota in other
engines. A new engine that would leave less than one chunk for the tenant, or take the
server past the machine's memory, is refused: its client sees misses, the others are served.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, replace

from kvtier.admin.server import AdminServer
from kvtier.config import Config
from kvtier.engine import Engine
from kvtier.errors import ConfigError, ProtocolError, StateError
from kvtier.keys import Fingerprint
from kvtier.layout import KVLayout, dtype_from_name, parse_groups
from kvtier.server.protocol import Hello
from kvtier.server.shared_memory import SharedPages
from kvtier.validation import check_fits_in_memory

log = logging.getLogger(__name__)


@dataclass
class ModelSlot:
    fingerprint: str  # hex
    tenant: str  # the cache_salt
    engine: Engine
    memory: SharedPages
    admin: AdminServer | None = None

    @property
    def admin_url(self) -> str | None:
        return self.admin.url if self.admin is not None and self.admin.running else None

    @property
    def cpu_bytes(self) -> int:
        return self.engine.num_pages * self.engine.chunk_bytes


class ModelTable:
    def __init__(self, config: Config) -> None:
        self.config = config
        self._slots: dict[str, ModelSlot] = {}
        self._lock = threading.Lock()
        self._closed = False

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
        fingerprint = Fingerprint(
            model_name=hello.model_name,
            layout=layout,
            chunk_size=config.chunk_size,
            hash_algorithm=config.pre_caching_hash_algorithm,
            tp_rank=hello.tp_rank,
            tp_world_size=hello.tp_world_size,
            cache_salt=config.cache_salt,
        ).hex()
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
            elif slot.engine.config.save_unfull_chunk != hello.save_unfull_chunk:
                raise ConfigError(
                    "save_unfull_chunk",
                    hello.save_unfull_chunk,
                    f"{slot.engine.config.save_unfull_chunk}, as the clients already serving "
                    "this model set it",
                )
            return slot

    def _make(self, hello: Hello, layout: KVLayout, config: Config) -> ModelSlot:
        config = replace(config, max_local_cpu_size=self._cpu_budget(hello, layout))
        memory = SharedPages(f"kvtier-{hello.fingerprint[:16]}")
        engine = Engine(
            config,
            layout,
            model_name=hello.model_name,
            tp_rank=hello.tp_rank,
            tp_world_size=hello.tp_world_size,
            page_memory=memory.make,
        )
        total = sum(s.cpu_bytes for s in self._slots.values())
        check_fits_in_memory("max_local_cpu_size", total + engine.num_pages * engine.chunk_bytes)
        try:
            engine.open()
        except BaseException:
            memory.close()
            raise
        slot = ModelSlot(hello.fingerprint, hello.cache_salt, engine, memory, self._admin(engine))
        log.info(
            "model %r (fingerprint %s, tenant %r): %d pages of %d bytes in shared memory%s",
            hello.model_name,
            hello.fingerprint[:16],
            hello.cache_salt,
            engine.num_pages,
            engine.chunk_bytes,
            f", admin API {slot.admin_url}" if slot.admin_url else "",
        )
        return slot

    def _admin(self, engine: Engine) -> AdminServer | None:
        """The model's admin API, dashboard and /metrics (``internal_api_server_enabled``):
        one port per model, the first free from ``internal_api_server_port_start``."""
        cfg = self.config
        if not cfg.internal_api_server_enabled:
            return None
        admin = AdminServer(
            engine,
            cfg.internal_api_server_host,
            cfg.internal_api_server_port_start,
            cfg.admin_token,
        )
        try:
            return admin.open()
        except OSError as exc:
            log.error("admin API not started for this model: %s", exc)
            return None

    def _cpu_budget(self, hello: Hello, layout: KVLayout) -> int:
        wanted = self.config.max_local_cpu_size
        quota = self.config.server_tenant_quota
        if quota is None:
            return wanted
        held = sum(s.cpu_bytes for s in self._slots.values() if s.tenant == hello.cache_salt)
        budget = min(wanted, quota - held)
        chunk = layout.chunk_bytes(hello.chunk_size)
        if budget < chunk:
            raise ConfigError(
                "server_tenant_quota",
                quota,
                f"room for one more chunk ({chunk} bytes) for tenant {hello.cache_salt!r}, "
                f"which already holds {held} bytes in other models",
            )
        return budget

    def slots(self) -> list[ModelSlot]:
        with self._lock:
            return list(self._slots.values())

    def close(self) -> None:
        """Close every engine (each drains its in-flight disk/Redis writes first)."""
        with self._lock:
            self._closed = True
            slots, self._slots = list(self._slots.values()), {}
        for slot in slots:
            try:
                if slot.admin is not None:
                    slot.admin.close()
                slot.engine.close()
            except Exception as exc:  # one engine failing to close must not skip the others
                log.error("closing model %s: %s", slot.fingerprint[:16], exc)
            finally:
                slot.memory.close()
