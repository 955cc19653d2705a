"""How a looked-up request's hit reaches the engine, for the engine's retrieve and the page
API's ``lease_pages``::

    plan(rid, prompt)            the plan rid's lookup pinned, kept on its lease, while the
                                 tokens still start with its hit (a memory compare, no hash);
                                 else a lookup now
    locate_skipped(plan, rid)    retrieve only: the chunks a skipping lookup never located,
                                 located and pinned now, or InputError
    load(plan, rid, out, ...)    the copy out of the tiers; a load that comes up short ends the
                                 request's hit there (``lease.limit``: never offered again)

One :class:`RequestLoads` per open engine, over its tiers and lease table.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from kvtier.errors import InputError, StateError
from kvtier.lease import Lease, LeaseTable
from kvtier.observability.observer import Observer
from kvtier.storage.counters import EngineCounters
from kvtier.storage.manager import StorageManager
from kvtier.storage.plan import ENGINE, LookupPlan
from kvtier.validation import Prompt


class RequestLoads:
    """See the module docstring. ``lookup(rid, prompt)``: the engine's lookup (it pins the
    plan in the lease), for a retrieve that has no plan to reuse."""

    def __init__(
        self,
        manager: StorageManager,
        leases: LeaseTable[LookupPlan],
        observer: Observer,
        counters: EngineCounters,
        lookup: Callable[[str, Prompt], object],
    ) -> None:
        self._manager = manager
        self._leases = leases
        self._observer = observer
        self._counters = counters
        self._lookup = lookup

    def plan(self, request_id: str, prompt: Prompt) -> LookupPlan:
        lease = self._leases.get(request_id)
        if lease is not None and lease.plan is not None and lease.keys is not None:
            hit = lease.plan.hit_tokens
            known = lease.keys
            if (
                prompt.salt == known.salt
                and len(prompt.tokens) >= hit
                and np.array_equal(prompt.tokens[:hit], known.tokens[:hit])
            ):
                return lease.plan
        self._lookup(request_id, prompt)
        lease = self._leases.get(request_id)
        assert lease is not None and lease.plan is not None
        return lease.plan

    def locate_skipped(self, plan: LookupPlan, request_id: str) -> None:
        """Replace the plan's leading ENGINE chunks (skipped at lookup: the caller said it
        holds them) with cached ones, pinned in the lease, or raise: never leave them as
        uninitialised rows of a tensor that claims to be KV."""
        lease = self._lease(request_id)
        skipped = [h.span for h in plan.hits if h.tier is ENGINE]
        found = self._manager.locate(skipped, lease, 0)
        if len(found.hits) < len(skipped):
            n = skipped[-1].end
            raise InputError(
                f"request {request_id!r} was looked up with skip_leading_tokens covering its "
                f"first {n} tokens, and the cache holds only {found.hit_tokens} of them: "
                f"retrieve() returns KV from token 0, so call retrieve_into(tokens, "
                f"{request_id!r}, out, skip_leading_tokens={n}) instead"
            )
        plan.hits[: len(skipped)] = found.hits
        plan.spare.extend(found.spare)

    def load(
        self,
        plan: LookupPlan,
        request_id: str,
        out: torch.Tensor | None,
        start: int,
        started: float,
    ) -> int:
        """Copy the plan's hit from ``start`` into ``out`` (None: leave it in its pages);
        the end of the loaded prefix. ``started``: when the retrieve began (its latency)."""
        lease = self._lease(request_id)
        planned = plan.hit_tokens
        with self._observer.load(lease, plan, start, started) as load:
            load.end = self._manager.load(plan, lease, out, start)
        if load.end < planned:
            lease.limit = plan.hit_chunks  # the rest is a miss for this request from now on
        self._counters.add(retrieved_tokens=load.copied, hit_tokens=load.copied)
        return load.end

    def _lease(self, request_id: str) -> Lease[LookupPlan]:
        lease = self._leases.get(request_id)
        if lease is None:
            raise StateError(f"request {request_id!r} ended before its retrieve")
        return lease
