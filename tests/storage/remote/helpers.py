"""What the remote tiers' tests share: a put that names its tenant, and the tenant rows as
``stats()`` writes them."""

from __future__ import annotations

import torch

from kvtier.keys import ChunkKey
from kvtier.storage.base import PutJob, PutResult, Tier
from kvtier.storage.tenants.rows import rows_dict
from tests.storage.tier_contract import Outcomes


def put_as(
    tier: Tier, tenant: str, key: ChunkKey, data: torch.Tensor, num_tokens: int
) -> PutResult:
    """Put ``data`` as a chunk of ``tenant``; wait for its outcome and for the writes."""
    done = Outcomes()
    tier.put(PutJob(key, data, num_tokens, tenant, done))
    result = done.wait(1)[0]
    tier.flush(10.0)
    return result


def tenant_rows(tier: Tier) -> dict[str, dict[str, int | None]]:
    """The tier's tenant rows by tenant (empty without quotas)."""
    return rows_dict(tier.tenants.rows()) if tier.tenants is not None else {}
