"""The ledger protocol: what a tier that takes tenants keeps per tenant, and how it is asked.

A tenant is the salt of one request (its ``cache_salt``; :data:`NO_SALT` for none). Every
tier that takes tenants is handed the engine's one quota table when it is built and keeps a
*ledger* over it, reached through the tier's one tenant attribute, ``Tier.tenants`` (None:
``tenant_quotas`` is not set; typed by what readers ask, :class:`TenantReport`). Who calls
what::

    the put of a chunk of t   ledger.charge(key, t) -> victims   t's own chunks to drop now
                              (the tier drops them; counted as quota evictions)
    the chunk leaves          ledger.release(key)                for any reason but a charge's
    kvtier explain            ledger.evicted_by_quota(keys)      key -> tenant, of the recent
    stats(), metrics          ledger.rows() -> [TenantRow]        one row per tenant (or "*")

Where the limit is enforced stays with each tier, because each has its own reason: the CPU
and disk tiers choose every victim in their eviction order
(:class:`~kvtier.storage.tenants.local.TenantPolicy`, a composite over the eviction policy);
Redis enforces in a server-side script and S3 with markers the fleet shares
(:mod:`kvtier.storage.tenants.remote` is their common part); the PD receive buffer holds a
reservation back instead of evicting (:mod:`kvtier.pd.tenant_shares`): it charges a
reservation, not a chunk, and answers only the report. None of them is forced into one
algorithm; they answer one protocol.

The constants below are defined once for all of them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from kvtier.keys import ChunkKey
from kvtier.storage.tenants.quotas import TenantQuotas
from kvtier.storage.tenants.rows import TenantRow

NO_SALT = ""  # the tenant of requests without a cache_salt
QUOTA_EVICTIONS_KEPT = 65536  # keys remembered as evicted by their tenant's quota (explain)
ASSIGNED_KEPT = 65536  # tenants named for keys not stored yet (a queued disk write, a restart)
# Tenants remembered (their counters: stats and metrics): past this many, a tenant that
# holds nothing more is forgotten (a salt per user must not grow a tier without bound).
TENANTS_KEPT = 4096


class TenantReport(Protocol):
    """What anyone asks of a tier's ledger (``Tier.tenants``): from any thread."""

    def evicted_by_quota(self, keys: Sequence[ChunkKey]) -> dict[ChunkKey, str]:
        """Of ``keys`` (just reported evicted), those a charge evicted, with their tenant."""
        ...

    def rows(self) -> list[TenantRow]:
        """One row per tenant this ledger counts (the only tenant report)."""
        ...


class TenantLedger(TenantReport, Protocol):
    """What each tier keeps per tenant (module docstring): the report, and the charges the
    tier itself makes, under its lock where it has one."""

    @property
    def quotas(self) -> TenantQuotas: ...

    def charge(self, key: ChunkKey, tenant: str) -> list[ChunkKey]:
        """``key`` (just stored) is ``tenant``'s: count it, and return the tenant's own
        victims while it is over its limit (forgotten here; the tier drops them)."""
        ...

    def release(self, key: ChunkKey) -> None:
        """``key`` left the tier for its own reasons (evicted for room, removed, corrupt): it
        counts no more. A no-op for a key not charged."""
        ...


@runtime_checkable
class TakesQuotas(Protocol):
    """A lower tier that keeps tenants: handed the engine's quota table once, as it is built
    (before ``open``), it makes its ledger (``Tier.tenants``) over it."""

    def attach_quotas(self, quotas: TenantQuotas) -> None: ...


class QuotaEvictions:
    """The last :data:`QUOTA_EVICTIONS_KEPT` keys evicted by their tenant's quota (key ->
    tenant), for explain. Not locked: a ledger calls it under its own lock, and a lookup is
    one C-level ``dict.get`` per key."""

    __slots__ = ("_keys",)

    def __init__(self) -> None:
        self._keys: OrderedDict[ChunkKey, str] = OrderedDict()

    def record(self, key: ChunkKey, tenant: str) -> None:
        keys = self._keys
        keys[key] = tenant
        keys.move_to_end(key)
        if len(keys) > QUOTA_EVICTIONS_KEPT:
            keys.popitem(last=False)

    def forget(self, key: ChunkKey) -> None:
        """``key`` is stored again: a later miss on it is no quota eviction."""
        self._keys.pop(key, None)

    def among(self, keys: Sequence[ChunkKey]) -> dict[ChunkKey, str]:
        found = map(self._keys.get, keys)
        return {k: t for k, t in zip(keys, found, strict=True) if t is not None}
