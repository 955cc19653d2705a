"""The quota table every tier of one cache reads: tenant -> limit, changed at run time.

One object per engine, held by the engine (``Engine.quotas``) and handed to every tier that
takes tenants when it is built (the CPU and disk tiers, Redis, S3, the PD buffer): the admin
API's ``PUT /quota`` (and LMCache's alias) asks the engine for it and changes it once, and
every tier sees the new limit at its next store (each tier's ledger subscribes, so a lowered
limit evicts at once). The rows come from ``tenant_quotas`` (:mod:`kvtier.config.tenant_quotas`);
``"*"`` is the row of every tenant the table does not name, and it is *one* row for all of
them together: the salts it covers share its limit (what they hold together is capped by it)
and its guarantee, as one tenant would. vLLM takes ``cache_salt`` from each request, so a
limit per unnamed salt would let one client that sprays salts claim the row many times over
(and, the guarantees being scaled by the sum of the limits held, shrink every named tenant's).
:meth:`TenantQuotas.row_of` names the row a tenant is counted under.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

from kvtier.config.tenant_quotas import DEFAULT_TENANT, TenantLimit

Listener = Callable[[], None]


class TenantQuotas:
    def __init__(self, rows: Mapping[str, TenantLimit] | None = None) -> None:
        self._rows: dict[str, TenantLimit] = dict(rows or {})
        self._overrides: dict[str, TenantLimit | None] = {}  # set at run time (None: removed)
        self._lock = threading.Lock()
        self._listeners: list[Listener] = []

    def limit(self, tenant: str) -> TenantLimit | None:
        """``tenant``'s row, else the ``"*"`` row, else None (no limit)."""
        rows = self._rows  # replaced whole on a change: a read needs no lock
        found = rows.get(tenant)
        return found if found is not None else rows.get(DEFAULT_TENANT)

    def row_of(self, tenant: str) -> str | None:
        """The row ``tenant`` is counted under: its own, else ``"*"`` (shared by every salt
        the table does not name), else None (no limit)."""
        rows = self._rows
        if tenant in rows:
            return tenant
        return DEFAULT_TENANT if DEFAULT_TENANT in rows else None

    def rows(self) -> dict[str, TenantLimit]:
        return dict(self._rows)

    def __bool__(self) -> bool:
        return bool(self._rows)

    def set(self, tenant: str, limit: TenantLimit | None) -> None:
        """Set (None: remove) ``tenant``'s row; every subscribed tier applies it now."""
        with self._lock:
            rows = dict(self._rows)
            if limit is None:
                rows.pop(tenant, None)
            else:
                rows[tenant] = limit
            self._rows = rows
            self._overrides[tenant] = limit
            listeners = list(self._listeners)
        for listener in listeners:
            listener()

    def overrides(self) -> dict[str, TenantLimit | None]:
        """The rows :meth:`set` changed since the config's (None: removed): what a disk
        tier saves, so that they outlive a restart."""
        with self._lock:
            return dict(self._overrides)

    def subscribe(self, listener: Listener) -> None:
        with self._lock:
            self._listeners.append(listener)

    def unsubscribe(self, listener: Listener) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)
