"""The s3 tier under ``tenant_quotas``: a cap per tenant on what *this engine* stored.

An object store has no atomic scripting and no cheap way to learn another engine's writes
but a listing, which names no tenant, so this cap is per engine, not fleet-wide: each
engine keeps, in memory, the chunks it stored for each tenant in store order (a chunk stored
again moves to the newest), and after a write of a tenant over its limit deletes that
tenant's oldest (one DeleteObjects)::

    write landed  -> the tenant's order gets the key; while it holds more than the limit,
                     its oldest go (a key the index no longer holds, deleted by another
                     engine or a lifecycle rule, leaves without a request: stale)
    refresh       -> keys the new listing lacks leave every order (they are gone)
    PUT /quota    -> every tenant brought within its new limit at once

What this means for a fleet of N engines: a tenant holds at most N times its limit, each
engine's share of it (a chunk another engine stored is counted by that engine only), and a
restarted engine starts counting from nothing (what it stored before stays, uncounted, until
deleted by something else: a lifecycle rule, ``clear``). A share (``"25%"``) has nothing to
be a share of: an object store reports no capacity, so share rows do not bind this tier
(one warning at open names them); byte rows do.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

from kvtier.errors import TierError
from kvtier.keys import ChunkKey
from kvtier.storage.policy.quotas import TenantQuotas
from kvtier.storage.remote_quotas import RemoteQuotas
from kvtier.storage.s3.client import S3Client
from kvtier.storage.s3.index import ChunkIndex

DELETE_BATCH = 1000  # DeleteObjects takes 1000 names at most

log = logging.getLogger(__name__)


class S3Quotas(RemoteQuotas):
    """Thread-safe: writer threads add, the lister prunes, the admin thread enforces."""

    def __init__(
        self,
        quotas: TenantQuotas,
        unit_bytes: int,
        index: ChunkIndex,
        client: S3Client,
        object_name: Callable[[ChunkKey], str],
    ) -> None:
        super().__init__(quotas, unit_bytes)
        self._index = index
        self._client = client
        self._object_name = object_name
        self._orders: dict[str, OrderedDict[ChunkKey, None]] = {}

    def _held(self, key: ChunkKey) -> bool:
        return self._index.contains((key,))[0]

    def limit_bytes(self, tenant: str) -> int | None:
        """Byte rows only: a share of an object store has no capacity to be a share of."""
        limit = self.quotas.limit(tenant)
        return None if limit is None or limit.nbytes is None else limit.nbytes

    def warn_shares(self) -> None:
        shares = sorted(t for t, limit in self.quotas.rows().items() if limit.share is not None)
        if shares:
            log.warning(
                "s3 tier: tenant_quotas rows %s are shares, and an object store has no "
                "capacity to take a share of: they do not bound this tier (give a size, "
                "e.g. '20GiB')",
                shares,
            )

    def stored(self, tenant: str, key: ChunkKey) -> list[ChunkKey]:
        """``key``'s write of ``tenant`` landed (it is in the index): the tenant's oldest
        over its limit are deleted and leave the index; returns them."""
        with self._lock:
            order = self._orders.setdefault(tenant, OrderedDict())
            order[key] = None
            order.move_to_end(key)
        return self._drop(self._trim(tenant))

    def enforce_all(self) -> list[ChunkKey]:
        """Every tenant within its limit now (a row changed): returns the keys deleted."""
        victims: list[ChunkKey] = []
        for tenant in self.tenants():
            victims += self._trim(tenant)
        return self._drop(victims)

    def _drop(self, keys: list[ChunkKey]) -> list[ChunkKey]:
        """Delete ``keys``' objects; they leave the index whether or not the store answered
        (a chunk left behind is no longer counted: a lifecycle rule or ``clear`` takes it)."""
        try:
            for start in range(0, len(keys), DELETE_BATCH):
                batch = keys[start : start + DELETE_BATCH]
                self._client.delete([self._object_name(k) for k in batch])
        except TierError as exc:
            log.warning("s3 tier: chunks over their tenant's quota not deleted: %s", exc)
        self._index.discard_many(keys)
        return keys

    def _trim(self, tenant: str) -> list[ChunkKey]:
        limit = self.limit_chunks(tenant)
        victims: list[ChunkKey] = []
        stale = 0
        with self._lock:
            order = self._orders.get(tenant, OrderedDict())
            while limit is not None and len(order) > limit:
                key, _ = order.popitem(last=False)
                if self._held(key):
                    victims.append(key)
                else:
                    stale += 1
            chunks = len(order)
        self.updated(tenant, chunks, victims, stale)
        return victims

    def prune(self) -> None:
        """After a listing: keys the index no longer holds leave every order."""
        with self._lock:
            orders = list(self._orders.items())
        for tenant, order in orders:
            with self._lock:
                gone = [key for key in order if not self._held(key)]
                for key in gone:
                    del order[key]
                chunks = len(order)
            self.updated(tenant, chunks, (), len(gone))
