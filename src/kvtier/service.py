"""A cache with the servers its config asks for, opened in order and closed in reverse.

:class:`kvtier.engine.Engine` is the cache alone: it binds no port and starts no server, so a
library user (a connector, a test, a benchmark) gets exactly what it asked for. A process that
*is* a kvtier node (``kvtier serve-admin``, a PD decoder, the kvtier server) opens a
:class:`Service`::

    open:   engine  ->  admin API (internal_api_server_enabled)  ->  PD receiver (pd_role receiver)
    close:  PD receiver  ->  admin API  ->  engine

so nothing serves an engine that is not open yet or any more. An admin port that cannot be
bound is logged and the service runs without it (the cache itself is unaffected); a PD port
that cannot be bound fails ``open`` (a decoder that cannot receive is no decoder).

A Service is also a cache: it has the surface connectors use (``kvtier.server.surface.KVCache``:
lookup, retrieve, store, end_request, stats, ...), each call going to its engine, and
``local_engine`` (its engine; a server client's is None) for what only an in-process engine
offers (PD hooks, the page API, ``tier(name)``). So whoever needs "the cache this process
runs" opens one Service and never assembles engine, admin API and receiver by hand.
"""

from __future__ import annotations

import logging
import mmap
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from types import TracebackType
from typing import Any

import torch

from kvtier.admin.server import AdminServer
from kvtier.config import Config
from kvtier.engine import Engine, Hit
from kvtier.errors import StateError
from kvtier.keys import Fingerprint, KeyChain, RequestKeys, RequestSalt
from kvtier.layout import KVLayout
from kvtier.lifecycle import Lifecycle
from kvtier.pd.receiver import PDReceiver
from kvtier.storage.base import Tier

log = logging.getLogger(__name__)


class Service:
    """An :class:`Engine`, its admin API and its PD receiver, as one lifecycle."""

    def __init__(
        self,
        config: Config | None,
        layout: KVLayout,
        *,
        model_name: str,
        tp_rank: int = 0,
        tp_world_size: int = 1,
        page_memory: Callable[[int], mmap.mmap] | None = None,
        lower_tiers: Sequence[Tier] | None = None,
    ) -> None:
        """``page_memory``, ``lower_tiers``: as :class:`Engine`'s (the kvtier server passes
        shared memory; a test passes ready-made tiers)."""
        self.engine = Engine(
            config,
            layout,
            model_name=model_name,
            tp_rank=tp_rank,
            tp_world_size=tp_world_size,
            page_memory=page_memory,
            lower_tiers=lower_tiers,
        )
        self.config = self.engine.config
        self.admin: AdminServer | None = None
        self.receiver: PDReceiver | None = None
        self._state = Lifecycle.NEW
        self._lock = threading.Lock()

    @property
    def local_engine(self) -> Engine:
        """The engine this process runs (a server client's ``local_engine`` is None)."""
        return self.engine

    def open(self) -> Service:
        with self._lock:
            if self._state is Lifecycle.OPEN:
                return self
            if self._state is Lifecycle.CLOSED:
                raise StateError("this Service is closed; create a new one")
            self.engine.open()
            try:
                self.admin = open_admin(self.engine)
                if self.engine.receiver_host().pd_buffer is not None:  # pd_role receiver
                    self.receiver = PDReceiver.for_engine(self.engine).open()
            except BaseException:
                self._close_parts()
                raise
            self._state = Lifecycle.OPEN
            return self

    def close(self) -> None:
        """Close the receiver, the admin API, then the engine. Idempotent."""
        with self._lock:
            if self._state is Lifecycle.CLOSED:
                return
            self._state = Lifecycle.CLOSED
            self._close_parts()

    def _close_parts(self) -> None:
        receiver, self.receiver = self.receiver, None
        admin, self.admin = self.admin, None
        try:
            if receiver is not None:
                receiver.close()
            if admin is not None:
                admin.close()
        finally:
            self.engine.close()

    @property
    def state(self) -> Lifecycle:
        return self._state

    @property
    def admin_url(self) -> str | None:
        """Base URL of the admin API while it runs (``internal_api_server_enabled``)."""
        return self.admin.url if self.admin is not None and self.admin.running else None

    def __enter__(self) -> Service:
        return self.open()

    # -- the cache surface (KVCache): the engine's ------------------------------------------
    @property
    def layout(self) -> KVLayout:
        return self.engine.layout

    @property
    def fingerprint(self) -> Fingerprint:
        return self.engine.fingerprint

    @property
    def keychain(self) -> KeyChain:
        return self.engine.keychain

    @property
    def chunk_bytes(self) -> int:
        return self.engine.chunk_bytes

    def lookup(
        self,
        tokens: object,
        request_id: str,
        *,
        skip_leading_tokens: int = 0,
        cache_salt: RequestSalt | None = None,
    ) -> Hit:
        return self.engine.lookup(
            tokens, request_id, skip_leading_tokens=skip_leading_tokens, cache_salt=cache_salt
        )

    def retrieve(
        self, tokens: object, request_id: str, *, cache_salt: RequestSalt | None = None
    ) -> torch.Tensor:
        return self.engine.retrieve(tokens, request_id, cache_salt=cache_salt)

    def retrieve_into(
        self,
        tokens: object,
        request_id: str,
        out: torch.Tensor,
        *,
        skip_leading_tokens: int = 0,
        cache_salt: RequestSalt | None = None,
    ) -> int:
        return self.engine.retrieve_into(
            tokens, request_id, out, skip_leading_tokens=skip_leading_tokens, cache_salt=cache_salt
        )

    def store(
        self,
        tokens: object,
        kv: torch.Tensor,
        *,
        skip_leading_tokens: int = 0,
        cache_salt: RequestSalt | None = None,
        keys: RequestKeys | None = None,
    ) -> int:
        return self.engine.store(
            tokens, kv, skip_leading_tokens=skip_leading_tokens, cache_salt=cache_salt, keys=keys
        )

    def request_keys(
        self,
        tokens: object,
        request_id: str | None = None,
        *,
        cache_salt: RequestSalt | None = None,
    ) -> RequestKeys:
        return self.engine.request_keys(tokens, request_id, cache_salt=cache_salt)

    def loading(self, request_id: str) -> AbstractContextManager[bool]:
        return self.engine.loading(request_id)

    def end_request(self, request_id: str) -> bool:
        return self.engine.end_request(request_id)

    @contextmanager
    def request(self, request_id: str) -> Iterator[str]:
        with self.engine.request(request_id) as rid:
            yield rid

    def record_ttft(self, seconds: float, *, prompt_tokens: int, hit_tokens: int) -> None:
        self.engine.record_ttft(seconds, prompt_tokens=prompt_tokens, hit_tokens=hit_tokens)

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def check_invariants(self) -> list[str]:
        return self.engine.check_invariants()

    def flush(self, timeout: float | None = None) -> bool:
        return self.engine.flush(timeout)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def open_admin(engine: Engine) -> AdminServer | None:
    """The admin API ``engine``'s config asks for (``internal_api_server_enabled``), open,
    or None. A port that cannot be bound is logged: the cache never fails for its dashboard.
    For any process that owns an open engine (a Service, a vLLM worker)."""
    cfg = engine.config
    if not cfg.internal_api_server_enabled:
        return None
    server = AdminServer(
        engine, cfg.internal_api_server_host, cfg.internal_api_server_port_start, cfg.admin_token
    )
    try:
        return server.open()
    except OSError as exc:
        log.error("kvtier admin API not started: %s", exc)
        return None
