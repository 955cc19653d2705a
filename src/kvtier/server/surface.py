"""The cache surface connectors use, met by an in-process Service and by a server client alike.

A connector typed against :class:`KVCache` takes either: ``open_cache`` gives an open
:class:`~kvtier.service.Service` (an Engine with the admin API and PD receiver its config asks
for) when no server is named, or a :class:`~kvtier.server.client.ServerClient` when one is (the
vLLM connector's ``kv_connector_extra_config: {"server": "unix:///..."}``). What only an
in-process engine offers (PD hooks, ``tier(name)``, ``leaks``) is behind ``local_engine``,
None for a server client.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from kvtier.admin.server import AdminServer
from kvtier.config import Config
from kvtier.engine import Engine, Hit
from kvtier.keys import Fingerprint, KeyChain, RequestKeys, RequestSalt
from kvtier.layout import KVLayout
from kvtier.lifecycle import Lifecycle
from kvtier.server.client import ServerClient
from kvtier.service import Service


class KVCache(Protocol):
    @property
    def config(self) -> Config: ...

    @property
    def layout(self) -> KVLayout: ...

    @property
    def fingerprint(self) -> Fingerprint: ...

    @property
    def keychain(self) -> KeyChain: ...

    @property
    def chunk_bytes(self) -> int: ...

    @property
    def state(self) -> Lifecycle: ...

    @property
    def local_engine(self) -> Engine | None:
        """The engine running in this process, or None (a server client)."""
        ...

    @property
    def admin(self) -> AdminServer | None:
        """The admin API this process serves for the cache, or None (off, or a server
        client: the server serves its own)."""
        ...

    def lookup(
        self,
        tokens: object,
        request_id: str,
        *,
        skip_leading_tokens: int = 0,
        cache_salt: RequestSalt | None = None,
    ) -> Hit: ...

    def retrieve(
        self, tokens: object, request_id: str, *, cache_salt: RequestSalt | None = None
    ) -> torch.Tensor: ...

    def retrieve_into(
        self,
        tokens: object,
        request_id: str,
        out: torch.Tensor,
        *,
        skip_leading_tokens: int = 0,
        cache_salt: RequestSalt | None = None,
    ) -> int: ...

    def store(
        self,
        tokens: object,
        kv: torch.Tensor,
        *,
        skip_leading_tokens: int = 0,
        cache_salt: RequestSalt | None = None,
        keys: RequestKeys | None = None,
    ) -> int: ...

    def request_keys(
        self,
        tokens: object,
        request_id: str | None = None,
        *,
        cache_salt: RequestSalt | None = None,
    ) -> RequestKeys: ...

    def loading(self, request_id: str) -> AbstractContextManager[bool]: ...

    def end_request(self, request_id: str) -> bool: ...

    def request(self, request_id: str) -> AbstractContextManager[str]: ...

    def record_ttft(self, seconds: float, *, prompt_tokens: int, hit_tokens: int) -> None: ...

    def stats(self) -> dict[str, Any]: ...

    def check_invariants(self) -> list[str]: ...

    def flush(self, timeout: float | None = None) -> bool: ...

    def close(self) -> None: ...


def open_cache(
    server: str | None,
    config: Config | None,
    layout: KVLayout,
    *,
    model_name: str,
    tp_rank: int = 0,
    tp_world_size: int = 1,
) -> KVCache:
    """An open cache: the kvtier server at ``server`` (``unix:///path``) when given, else an
    in-process :class:`Service` (engine, then the admin API and PD receiver its config asks
    for; closing it closes them in reverse)."""
    if server:
        client = ServerClient(
            server,
            layout,
            model_name=model_name,
            config=config,
            tp_rank=tp_rank,
            tp_world_size=tp_world_size,
        )
        return client.open()
    service = Service(
        config, layout, model_name=model_name, tp_rank=tp_rank, tp_world_size=tp_world_size
    )
    return service.open()


def _all_conform(service: Service, client: ServerClient) -> Iterator[KVCache]:
    """Never called: mypy --strict checks here that both classes have the whole surface."""
    yield service
    yield client
