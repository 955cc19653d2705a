"""What an engine's requests do, shared by the engine and its page view (package-private).

:class:`EngineCore` is the part of an :class:`~kvtier.engine.Engine` that both of its faces
use: the call guard, the parts that exist only while it is open, and a request's steps over
them. ``Engine`` (the copying calls, the lifecycle, inspection) and ``engine.pages()`` (the
same calls without the copy) both ask it; neither reaches into the other::

    Engine       (engine.py) ──┐
                               ├──> EngineCore ──> OpenParts (manager, leases, pool)
    EnginePages  (_pages.py) ──┘

A request's steps::

    keys_for(tokens, salt, lease)  the prompt's chunk keys, hashed once per request (kept on
                                   its lease)
    lookup(rid, prompt)            locate and pin the cached prefix in rid's lease
    plan(rid, prompt)              the plan rid's lookup pinned, while the tokens still start
                                   with its hit (a memory compare, no hash); else a lookup now
    locate_skipped(plan, rid)      retrieve only: the chunks a skipping lookup never located,
                                   located and pinned now, or InputError
    load(plan, rid, out, ...)      the copy out of the tiers; a load that comes up short ends
                                   the request's hit there (``lease.limit``: never offered
                                   again)
    end_request(rid)               release everything rid holds, count it

Nothing outside :mod:`kvtier.engine` imports this module.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.config import Config
from kvtier.engine._checkpoints import check_checkpoints, extend_to_checkpoint
from kvtier.errors import InputError, StateError
from kvtier.hit import Hit
from kvtier.keys import KeyChain, RequestKeys
from kvtier.lease import Lease, LeaseTable
from kvtier.lifecycle import CallGuard, Lifecycle
from kvtier.memory.block_pool import BlockPool
from kvtier.observability.observer import Observer
from kvtier.request_salt import RequestSalt, keyed_by
from kvtier.storage.counters import EngineCounters
from kvtier.storage.lookup import ENGINE, LookupPlan
from kvtier.storage.manager import StorageManager
from kvtier.validation import Prompt


@dataclass(frozen=True)
class OpenParts:
    """What ``Engine.open`` builds and ``close`` frees: the tiers, the requests' leases and
    the page memory under them."""

    manager: StorageManager
    leases: LeaseTable[LookupPlan]
    pool: BlockPool


class EngineCore:
    """See the module docstring. One per engine, made with it."""

    def __init__(
        self, config: Config, keychain: KeyChain, counters: EngineCounters, observer: Observer
    ) -> None:
        self.config = config
        self.keychain = keychain
        self.counters = counters
        self.observer = observer
        self.guard = CallGuard("Engine")  # the lifecycle, and the public calls in flight
        self._parts: OpenParts | None = None

    def attach(self, parts: OpenParts) -> None:
        """``open``: the parts exist from now on (the guard opens after this)."""
        self._parts = parts

    def detach(self) -> OpenParts | None:
        """``close``, once the guard refuses new calls: the parts to free, or None when the
        engine never opened."""
        parts, self._parts = self._parts, None
        return parts

    def parts(self) -> OpenParts:
        """The open engine's parts, or StateError that says how to get an open one."""
        state = self.guard.state
        if state is not Lifecycle.OPEN:
            hint = (
                "call open() or use `with Engine(...)`"
                if state is Lifecycle.NEW
                else "it was closed"
            )
            raise StateError(f"Engine is {state.value}: {hint}")
        assert self._parts is not None
        return self._parts

    def call(self) -> AbstractContextManager[None]:
        """A call counted in flight: ``close`` waits for it before freeing the parts."""
        return self.guard.call()

    def keys_for(
        self, tokens: np.ndarray, salt: RequestSalt | None, lease: Lease[LookupPlan] | None
    ) -> RequestKeys:
        """The keys of ``tokens``: reused from the lease where it knows them (only chunks it
        does not know are hashed); the lease keeps them when they extend its tokens."""
        known = lease.keys if lease is not None else None
        if known is None:
            return RequestKeys(self.keychain, tokens, salt, self.config.save_unfull_chunk)
        made = known.for_tokens(tokens, salt)
        if (
            lease is not None
            and made is not known
            and salt == known.salt
            and len(tokens) > len(known.tokens)
            and np.array_equal(tokens[: len(known.tokens)], known.tokens)
        ):
            lease.keys = made  # the same prompt, longer: what a later store hashed
        return made

    def end_request(self, request_id: str) -> bool:
        """Release everything ``request_id`` holds and count it (its log line, its unused
        tokens). False when it held nothing."""
        leases = self.parts().leases
        lease = leases.get(request_id)
        ended = leases.end(request_id)
        if ended and lease is not None:
            unused = self.observer.on_request_end(lease)
            self.counters.add(requests=1, unused_tokens=unused)
        return ended

    # -- a request's lookup and load ----------------------------------------------------
    def lookup(self, request_id: str, prompt: Prompt) -> Hit:
        """Pins the hit for ``request_id``. The prompt's keys stay with the request's lease,
        so its loads do not hash it again (nor its stores, for the chunks the lookup hashed)."""
        started = time.perf_counter()
        parts = self.parts()
        manager, leases = parts.manager, parts.leases
        if prompt.checkpoints:
            check_checkpoints(prompt.checkpoints, self.config.chunk_size)
        tokens, salt = prompt.tokens, prompt.salt
        lease = leases.open(request_id)
        keys = self.keys_for(tokens, salt, lease)
        lease.keys = keys  # what the plan below is made of
        spans = keys.spans
        if lease.limit is not None:
            # A load of this request came up short at chunk ``limit``: from there on the
            # chunks are a miss for it, whatever the tiers say now (never offered again).
            spans = spans[: lease.limit]
        plan = manager.locate(spans, lease, prompt.skip // self.config.chunk_size)
        if prompt.checkpoints:
            keys, plan = extend_to_checkpoint(
                manager, self.keychain, keys, plan, lease, prompt.checkpoints
            )
            lease.keys, spans = keys, keys.spans
        lease.plan = plan
        found = self.observer.on_lookup(lease, tokens, spans, plan, started, keyed_by(salt))
        # lookup_tokens: the whole prompt, partial tail included. The hit is counted when
        # loaded (_load): a lookup only finds.
        self.counters.add(lookups=1, lookup_tokens=len(tokens), found_tokens=found)
        return Hit(plan.hit_tokens, plan.cpu_tokens)

    def plan(self, request_id: str, prompt: Prompt) -> LookupPlan:
        lease = self.parts().leases.get(request_id)
        if lease is not None and lease.plan is not None and lease.keys is not None:
            hit = lease.plan.hit_tokens
            known = lease.keys
            if (
                prompt.salt == known.salt
                and len(prompt.tokens) >= hit
                and np.array_equal(prompt.tokens[:hit], known.tokens[:hit])
            ):
                return lease.plan
        self.lookup(request_id, prompt)
        lease = self.parts().leases.get(request_id)
        assert lease is not None and lease.plan is not None
        return lease.plan

    def locate_skipped(self, plan: LookupPlan, request_id: str) -> None:
        """Replace the plan's leading ENGINE chunks (skipped at lookup: the caller said it
        holds them) with cached ones, pinned in the lease, or raise: never leave them as
        uninitialised rows of a tensor that claims to be KV."""
        lease = self._lease(request_id)
        skipped = [h.span for h in plan.hits if h.tier is ENGINE]
        found = self.parts().manager.locate(skipped, lease, 0)
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
        base: int = 0,
    ) -> int:
        """Copy the plan's hit from ``start`` into ``out`` (None: leave it in its pages; row 0
        of ``out`` is token ``base``); the end of the loaded prefix. ``started``: when the
        retrieve began (its latency)."""
        lease = self._lease(request_id)
        planned = plan.hit_tokens
        with self.observer.load(lease, plan, start, started) as load:
            load.end = self.parts().manager.load(plan, lease, out, start, base)
        if load.end < planned:
            lease.limit = plan.hit_chunks  # the rest is a miss for this request from now on
        self.counters.add(retrieved_tokens=load.copied, hit_tokens=load.copied)
        return load.end

    def _lease(self, request_id: str) -> Lease[LookupPlan]:
        lease = self.parts().leases.get(request_id)
        if lease is None:
            raise StateError(f"request {request_id!r} ended before its retrieve")
        return lease
