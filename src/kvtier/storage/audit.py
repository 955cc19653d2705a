"""The reference audit behind ``Engine.check_invariants``: every page reference has an owner.

Owners of a CPU page reference (see :mod:`kvtier.memory.block_pool`): a CPU cache entry, a
request lease, a lower-tier write still in flight. The audit counts them and compares::

    refcount < owners   a page was freed (or reused) while someone still owned it
    refcount > owners   a reference nobody owns: a leak (checked when no request is open,
                        since a lease may be taking pages while the audit reads)
    free list length != pages with refcount 0

and, invariant 3, that no chunk a request pinned in the CPU tier was evicted meanwhile.
"""

from __future__ import annotations

from kvtier.lease import LeaseTable
from kvtier.storage.lookup import LookupPlan
from kvtier.storage.manager import StorageManager


def audit_references(manager: StorageManager, leases: LeaseTable[LookupPlan]) -> list[str]:
    """Problems as sentences; empty when every reference is accounted for."""
    pool = manager.pool
    with manager.writes_in_flight.lock:  # refcounts and write counts from one instant
        refs, free_pages = pool.snapshot()
        writing = dict(manager.writes_in_flight.by_page)
    problems = [f"page {p} has negative refcount {r}" for p, r in enumerate(refs) if r < 0]
    held_by_leases: dict[int, int] = {}
    for lease in leases.live():
        for page in lease.pages:
            held_by_leases[page] = held_by_leases.get(page, 0) + 1
    cached = manager.cpu.owned_pages()
    no_request_open = not len(leases)
    for page, ref in enumerate(refs):
        owners = held_by_leases.get(page, 0) + writing.get(page, 0) + (page in cached)
        if ref < owners:
            problems.append(f"page {page}: refcount {ref} < {owners} owners (freed while in use)")
        if no_request_open and ref > owners:
            problems.append(f"page {page}: refcount {ref} but only {owners} owners (leaked)")
    problems.extend(_pinned_cpu_hits_evicted(manager, leases))
    if free_pages != sum(1 for r in refs if r == 0):
        problems.append("free list does not match the pages with refcount 0")
    return problems


def _pinned_cpu_hits_evicted(manager: StorageManager, leases: LeaseTable[LookupPlan]) -> list[str]:
    problems = []
    for lease in leases.live():
        plan = lease.plan
        if plan is None:
            continue
        cpu_hits = [h for h in plan.hits if h.tier is manager.cpu]
        entries = manager.cpu.entries([h.span.key for h in cpu_hits])
        for hit, entry in zip(cpu_hits, entries, strict=True):
            # A coded CPU tier's entry has no page (its hits are decoded into pages of
            # their own at load): there it must only still be there.
            if entry is None or (manager.cpu.resident and entry.page != hit.page):
                problems.append(
                    f"request {lease.request_id}: pinned CPU chunk {hit.span.index} was evicted"
                )
    return problems
