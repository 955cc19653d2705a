"""The engine's page API, for a process that maps the page buffer (the kvtier server).

``Engine.pages()`` returns this view; nothing else in the engine knows it exists. Instead of
copying KV in or out, a caller that shares the engine's page memory is handed pages::

    lease_pages(tokens, rid)     retrieve without the copy: the cached prefix's chunks, each
                                 resident in a page rid's lease holds   -> (end, [(page, start, n)])
    reserve_pages(tokens, rid)   store without the copy: a page for each chunk not yet held,
                                 held by rid's lease                    -> [StoreSlot]
        ... the caller fills the pages ...
    commit_pages(rid, slots)     publish them, then end rid             -> chunks stored
    copying(rid, landed)         the caller's device copies into or out of rid's pages land
                                 at ``landed``: the lease gives the pages back only after it

Ending ``rid`` before the commit gives reserved pages back unstored. Every call runs under the
engine's call guard, like the engine's own public calls.
"""

from __future__ import annotations

import time

from kvtier.engine._core import EngineCore
from kvtier.errors import StateError
from kvtier.keys import RequestKeys
from kvtier.memory.device import Landed
from kvtier.request_salt import RequestSalt, tenant_of
from kvtier.storage.lookup import ENGINE
from kvtier.storage.writes import StoreSlot
from kvtier.validation import check_keys, check_prompt, check_request_id


class EnginePages:
    """See the module docstring."""

    def __init__(self, core: EngineCore) -> None:
        self._core = core

    def lease_pages(
        self,
        tokens: object,
        request_id: str,
        *,
        skip_leading_tokens: int = 0,
        cache_salt: RequestSalt | None = None,
    ) -> tuple[int, list[tuple[int, int, int]]]:
        """``Engine.retrieve_into`` without the copy: the chunks of the cached prefix from the
        skip on, each resident in a page that ``request_id``'s lease holds until
        ``end_request``. Returns (end of the loaded prefix, [(page, start, tokens)])."""
        core = self._core
        with core.call():
            started = time.perf_counter()
            check_request_id(request_id)
            prompt = check_prompt(tokens, skip_leading_tokens, cache_salt)
            plan = core.plan(request_id, prompt)
            chunk = core.config.chunk_size
            start = (prompt.skip // chunk) * chunk
            loaded_end = core.load(plan, request_id, None, start, started)
            pages = [
                (h.page, h.span.start, h.span.num_tokens)
                for h in plan.hits
                if h.tier is not ENGINE and h.span.end > start and h.page is not None
            ]
            return loaded_end, pages

    def reserve_pages(
        self,
        tokens: object,
        request_id: str,
        *,
        skip_leading_tokens: int = 0,
        cache_salt: RequestSalt | None = None,
        keys: RequestKeys | None = None,
    ) -> list[StoreSlot]:
        """``Engine.store`` without the copy: a page for each chunk of ``tokens`` not yet held
        (from the skip on), held by ``request_id``'s lease. Fill them, then
        :meth:`commit_pages`; ending the request first gives them back unstored. ``keys``:
        the tokens' keys from ``request_keys`` (as ``Engine.store`` takes them)."""
        core = self._core
        with core.call():
            started = time.perf_counter()
            parts = core.parts()
            manager, leases = parts.manager, parts.leases
            check_request_id(request_id)
            prompt = check_prompt(tokens, skip_leading_tokens, cache_salt)
            array = prompt.tokens
            if keys is not None:
                check_keys(keys, core.keychain, prompt)
            spans = (keys if keys is not None else core.keys_for(array, prompt.salt, None)).spans
            core.counters.add(stores=1)
            offered = spans[prompt.skip // core.config.chunk_size :]
            slots, dropped = manager.reserve(offered, tenant_of(prompt.salt))
            leases.open(request_id).take_pages([slot.page for slot in slots])
            core.observer.on_store(array, offered, dropped, started)
            return slots

    def commit_pages(self, request_id: str, slots: list[StoreSlot]) -> int:
        """Publish pages :meth:`reserve_pages` gave ``request_id`` and filled since, then end
        the request. Returns chunks newly stored."""
        core = self._core
        with core.call():
            parts = core.parts()
            manager, leases = parts.manager, parts.leases
            lease = leases.get(request_id)
            if lease is None or not set(s.page for s in slots) <= set(lease.pages):
                raise StateError(f"request {request_id!r} holds no reservation for these pages")
            stored = manager.commit(slots)
            core.end_request(request_id)
            manager.cpu.enforce_quota(slots[0].tenant if slots else None)  # pages let go
            return stored

    def copying(self, request_id: str, landed: Landed) -> None:
        """Device copies into or out of pages ``request_id``'s lease holds (a kernel that
        reads them in place) land at ``landed``: the lease waits for it before it gives the
        pages back. A request that ended already waits now."""
        with self._core.call():
            lease = self._core.parts().leases.get(request_id)
            if lease is None:
                landed.wait()
                return
            lease.copying(landed)
