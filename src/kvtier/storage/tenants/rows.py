"""``TenantRow``: the one report of what a tenant holds in one tier, whatever the tier.

Every tier that takes tenants (CPU, disk, Redis, S3, the PD receive buffer) reports through
its ledger's ``rows()`` in this one type; ``Engine.stats()`` writes each row out with
:meth:`TenantRow.as_dict` under ``stats["tiers"][tier]["tenants"][tenant]``, and the
Prometheus metrics (:mod:`kvtier.observability.metrics`) take their series from the fields'
``metric`` metadata, so a field and its metric are declared once, here.

Fields a kind of tier cannot know are None and left out of ``as_dict`` when
``optional`` (a remote store's ``guarantee_bytes``, the PD buffer's ``evictions``); ``hits``
stays in as None where a read does not know its tenant (a remote key hashes its salt in).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


def _metric(
    name: str, kind: str, doc: str, *, optional: bool = False, required: bool = False
) -> Any:
    meta = {"metric": (name, kind, doc), "optional": optional}
    return field(metadata=meta) if required else field(default=None, metadata=meta)


def _extra() -> Any:
    return field(default=None, metadata={"optional": True})


@dataclass(frozen=True, slots=True)
class TenantRow:
    """One tenant in one tier. Bytes are whole units (a page, a chunk's file or record)."""

    tenant: str
    held_bytes: int = _metric(
        "kvtier_tenant_held_bytes", "gauge", "Bytes a tenant's chunks hold.", required=True
    )
    limit_bytes: int | None = _metric(
        "kvtier_tenant_limit_bytes", "gauge", "A tenant's quota (tenant_quotas).", required=True
    )  # None: no limit
    # None: no limit (or a tier that keeps no guarantee); 0: lapsed (its chunks did not return)
    guarantee_bytes: int | None = _metric(
        "kvtier_tenant_guarantee_bytes",
        "gauge",
        "Room kept for a tenant now (0: lapsed, its chunks were not coming back).",
        optional=True,
    )
    chunks: int = field(default=0)  # chunks (the PD buffer: page references) it holds
    hits: int | None = _metric(
        "kvtier_tenant_hit_chunks", "counter", "Chunks of a tenant hit by lookups."
    )
    evictions: int | None = _metric(
        "kvtier_tenant_evictions", "counter", "A tenant's chunks evicted.", optional=True
    )
    quota_evictions: int | None = _metric(
        "kvtier_tenant_quota_evictions",
        "counter",
        "A tenant's chunks evicted because it was over its own quota.",
        optional=True,
    )
    stale_entries: int | None = _extra()  # a remote ledger's members already gone
    reservations: int | None = _extra()  # the PD buffer: live reservations
    share_waits: int | None = _extra()  # ... that waited for the tenant's share
    share_refusals: int | None = _extra()  # ... refused for it

    def as_dict(self) -> dict[str, int | None]:
        """The row as ``stats()`` reports it (without ``tenant``: it is the key)."""
        out: dict[str, int | None] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "tenant" or (value is None and f.metadata.get("optional")):
                continue
            out[f.name] = value
        return out


def metric_fields() -> list[tuple[str, str, str, str]]:
    """(field, metric name, kind, help) of every field with a metric, in declaration order."""
    return [
        (f.name, *f.metadata["metric"])
        for f in dataclasses.fields(TenantRow)
        if "metric" in f.metadata
    ]


def rows_dict(rows: list[TenantRow]) -> dict[str, dict[str, int | None]]:
    """``rows`` as ``stats()`` reports them: tenant -> :meth:`TenantRow.as_dict`."""
    return {row.tenant: row.as_dict() for row in rows}
