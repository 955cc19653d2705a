"""RemoteQuotas: what a remote tier's ledger needs from the engine's quota table (each
put's tenant, its limit in whole chunks) and what it reports per tenant."""

from __future__ import annotations

from kvtier.config.tenant_quotas import TenantLimit, parse_limit
from kvtier.storage.tenants.ledger import TENANTS_KEPT
from kvtier.storage.tenants.quotas import TenantQuotas
from kvtier.storage.tenants.remote import RemoteQuotas
from kvtier.storage.tenants.rows import rows_dict

UNIT = 1000


def quotas(**rows: str) -> RemoteQuotas:
    table = {t.replace("STAR", "*"): parse_limit("tenant_quotas", v) for t, v in rows.items()}
    return RemoteQuotas(TenantQuotas(table), UNIT)


def test_limits_are_whole_chunks_rounded_down_and_a_share_is_of_the_capacity() -> None:
    q = quotas(bob="2999B", STAR="50%")
    assert q.limit_chunks("bob") == 2
    assert q.limit_chunks("anyone") == 0  # capacity not read yet
    q.capacity_bytes = 10_000
    assert q.limit_bytes("anyone") == 5000 and q.limit_chunks("anyone") == 5
    q.quotas.set("bob", TenantLimit(nbytes=999))
    assert q.below_one_chunk("anyone") is None
    assert q.below_one_chunk("bob") == (
        "the quota of tenant 'bob' (999 B: 999 bytes here) is below one chunk (1000 bytes); "
        "raise it to at least that"
    )
    assert quotas().limit_chunks("x") is None and quotas().below_one_chunk("x") is None


def test_the_report_holds_what_the_ledger_said_and_explain_finds_the_evicted() -> None:
    q = quotas(t="5000B")
    q.updated("t", 5, [b"a", b"b"], stale=1)
    q.updated("t", 4, [b"c"])
    assert rows_dict(q.rows()) == {
        "t": {
            "held_bytes": 4 * UNIT,
            "limit_bytes": 5000,
            "chunks": 4,
            "hits": None,
            "evictions": 3,
            "quota_evictions": 3,
            "stale_entries": 1,
        }
    }
    assert q.evicted_by_quota([b"a", b"x", b"c"]) == {b"a": "t", b"c": "t"}


def test_past_the_tenants_kept_one_that_holds_nothing_is_forgotten() -> None:
    q = quotas()
    q.updated("empty", 0, ())
    for i in range(TENANTS_KEPT - 1):
        q.updated(f"t{i}", 1, ())
    q.updated("new", 1, ())
    tenants = q.tenants()
    assert "empty" not in tenants and "new" in tenants and len(tenants) == TENANTS_KEPT
