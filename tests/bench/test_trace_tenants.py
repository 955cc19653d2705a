"""``kvtier bench trace --tenants``: per-tenant hit ratios of a multi-tenant trace with and
without quotas, through kvtier's real CPU tier (``kvtier.bench.trace_tenants``)."""

from __future__ import annotations

import argparse
import random

import pytest

from kvtier.bench import trace_tenants
from kvtier.bench.trace_file import Trace, chain
from kvtier.config.tenant_quotas import TenantLimit
from kvtier.errors import InputError

BLOCK = 16


def small_trace() -> Trace:
    """Two chat tenants that come back to a few prefixes, and a scanner reading new
    documents once: without quotas the scanner flushes the chat prefixes."""
    rng = random.Random(7)
    contents: list[list[int]] = []
    tenants: list[str] = []
    fresh = iter(range(10**6))
    prefixes = {t: [[next(fresh) for _ in range(4)] for _ in range(3)] for t in ("a", "b")}
    for n in range(1500):
        if n % 3 == 2:
            contents.append([next(fresh) for _ in range(rng.randint(6, 12))])
            tenants.append("scan")
        else:
            tenant = "a" if n % 3 == 0 else "b"
            contents.append([*rng.choice(prefixes[tenant]), next(fresh)])
            tenants.append(tenant)
    tokens = [[BLOCK] * (len(ids) - 1) + [BLOCK // 2] for ids in contents]
    return Trace(chain(contents), tokens, BLOCK, tenants)


def args(capacity: float, *quota: str) -> argparse.Namespace:
    return argparse.Namespace(
        capacity=capacity, policy="LRU", save_unfull_chunk=False, quota=list(quota), scan="scan"
    )


def test_a_scanner_under_quota_leaves_the_others_what_they_get_alone() -> None:
    trace = small_trace()
    capacity = 40.5 / trace.unique_blocks()  # 40 blocks: the 24 prefix blocks fit beside 10
    out = trace_tenants.section(trace, args(capacity, "scan=25%"))
    rows = out["tenants"]
    for tenant in ("a", "b"):
        assert rows[tenant]["shared"] < rows[tenant]["alone"] - 0.05  # the scan flushes them
        assert abs(rows[tenant]["quotas"] - rows[tenant]["alone"]) <= 0.02
        assert rows[tenant]["quota_of_opt_share"] > 0.9
    assert out["others_within_0_02"] is True
    assert out["others_worst_gap"] <= 0.02
    assert rows["scan"]["share_blocks"] == 10  # 25 % of 40
    assert out["tenant_quotas"] == {"scan": "25%"}


def test_the_default_quota_is_the_scanner_at_a_tenth_and_rows_are_checked() -> None:
    assert trace_tenants.parse_quotas([], "scan") == {"scan": TenantLimit(share=0.10)}
    assert trace_tenants.parse_quotas(["*=20%", "x=1KiB"], "scan") == {
        "*": TenantLimit(share=0.2),
        "x": TenantLimit(nbytes=1024),
    }
    with pytest.raises(InputError, match="TENANT=LIMIT"):
        trace_tenants.parse_quotas(["scan"], "scan")


def test_a_trace_without_tenants_is_refused_by_name() -> None:
    trace = Trace([[1, 2]], [[BLOCK, BLOCK // 2]], BLOCK)
    with pytest.raises(InputError, match="names no tenants"):
        trace_tenants.section(trace, args(0.5))
