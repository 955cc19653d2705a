"""Pins taken by key (``Tier.pin``) on tiers whose entries live in pool pages.

A pin is one page reference taken for whoever called ``pin(key)``; ``unpin(key)`` gives one
back. This table remembers which page each pin referenced (the entry may be replaced or
dropped meanwhile, the pinned page stays alive), so ``unpin`` releases the page it pinned,
and an ``unpin`` with no pin left is a no-op, never a second release. It takes and gives no
reference itself: the tier retains when it records and releases what :meth:`take` returns.
Not thread-safe: the owning tier calls it under its own lock.
"""

from __future__ import annotations

from kvtier.keys import ChunkKey


class KeyPins:
    def __init__(self) -> None:
        self._pages: dict[ChunkKey, list[int]] = {}

    def record(self, key: ChunkKey, page: int) -> None:
        """One pin of ``key``, holding a reference to ``page`` that the caller took."""
        self._pages.setdefault(key, []).append(page)

    def take(self, key: ChunkKey) -> int | None:
        """The page of one pin of ``key`` (its reference now the caller's to release), or
        None when ``key`` holds no pin."""
        pages = self._pages.get(key)
        if not pages:
            return None
        page = pages.pop()
        if not pages:
            del self._pages[key]
        return page

    def __contains__(self, key: object) -> bool:
        return key in self._pages

    def references_to(self, page: int) -> int:
        """Pins that hold ``page`` (for the reference audit)."""
        return sum(pages.count(page) for pages in self._pages.values())

    def clear(self) -> None:
        self._pages.clear()
