"""The PD receive buffer's page audit: every page reference has an owner, and only owned pages
are findable.

The owners are the two of :mod:`kvtier.pd.buffer`'s table (a reservation, one reference per
page it holds; a key pin, one per pin); the index owns none. So, page by page::

    refcount(page) == references the owners hold + key pins on it    (given the owners' view)
    free list      == the pages of refcount 0
    index entries  lie on pages of refcount > 0 only

The owners' view (``expected_refs``) comes from the engine's leases
(:meth:`PDBuffer.audit <kvtier.pd.buffer.PDBuffer.audit>`); without it only the last two rules
are checked.
"""

from __future__ import annotations

from kvtier.memory.block_pool import BlockPool
from kvtier.pd.received_index import ReceivedIndex
from kvtier.storage.key_pins import KeyPins


def page_problems(
    pool: BlockPool,
    index: ReceivedIndex,
    key_pins: KeyPins,
    expected_refs: dict[int, int] | None = None,
) -> list[str]:
    """Each broken rule as a sentence (empty when all hold); under the buffer's lock."""
    refs = pool.refcounts()
    problems: list[str] = []
    if pool.free_pages != refs.count(0):
        problems.append(f"{pool.free_pages} free pages listed, {refs.count(0)} with refcount 0")
    problems += index.on_free_pages(refs)
    if expected_refs is not None:
        for page, ref in enumerate(refs):
            want = expected_refs.get(page, 0) + key_pins.references_to(page)
            if ref != want:
                problems.append(f"page {page}: refcount {ref}, owners {want}")
    return problems
