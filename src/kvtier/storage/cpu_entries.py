"""Where a CPU tier's entries keep their bytes: the seam of :class:`~kvtier.storage.cpu.CpuTier`.

The tier keeps the index, the policy, tenants, pins and eviction; an :class:`Entries` says
what an entry is. :class:`PageEntries` (the default): an entry is a page of the block pool,
taking over the reference the storing caller had, served from it with no copy. A codec's
entries (:class:`~kvtier.storage.cpu_coded.CodedEntries`) are its stored bytes in a store of
their own, decoded at each read::

    CpuTier ── index: key -> entry ── policy (LRU, REUSE; per tenant)
       └── Entries: the pool an entry's references are in (``holder``), the one reference
           a pin and eviction look at (``pin_ref``), how a page becomes an entry
           (``prepare`` / ``admit`` / ``settle``), how an entry is read (``read_into``)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Protocol

import torch

from kvtier.memory.block_pool import BlockPool


@dataclass(slots=True, eq=False)  # identity: pin_prefix finds None among entries in C
class CpuEntry:
    page: int
    num_tokens: int
    nbytes: int


PAGE_OF = attrgetter("page")  # an entry's page, for a C-level map over entries


class Entries(Protocol):
    """Where a CPU tier's entries keep their bytes (see the module docstring). An entry holds
    one reference to each of ``refs(entry)`` in ``holder``; a pin holds one more to
    ``pin_ref(entry)``, which eviction looks at."""

    holder: BlockPool
    resident: bool  # an entry is a page of the tier's pool: served with no copy, no staging

    def pin_ref(self, entry: Any) -> int: ...

    def refs(self, entry: Any) -> list[int]: ...

    def num_tokens(self, entry: Any) -> int: ...

    def stored_bytes(self, entry: Any) -> int: ...

    def prepare(self, page: int, num_tokens: int) -> Any:
        """Outside the tier's lock: what ``admit`` needs of the page (a codec's output)."""

    def admit(self, page: int, num_tokens: int, prepared: Any, room: Callable[[int], int]) -> Any:
        """Under the lock: the entry for ``page``, or None when there is no room even after
        ``room(n)`` evicted entries for ``n`` references of ``holder``."""

    def settle(self, page: int) -> None:
        """After an admitted insert: the caller's page reference (an entry that is not the
        page gives it back)."""

    def read_into(self, entry: Any, out: torch.Tensor) -> None:
        """Copy the entry's payload into ``out``; :class:`CorruptRecord` when it is not what
        was stored."""


class PageEntries:
    """An entry is a page of the pool, taking over the caller's reference to it."""

    resident = True

    def __init__(self, pool: BlockPool, payload: Callable[[int], int]) -> None:
        self.holder = pool
        self._payload = payload

    def pin_ref(self, entry: CpuEntry) -> int:
        return entry.page

    def refs(self, entry: CpuEntry) -> list[int]:
        return [entry.page]

    def num_tokens(self, entry: CpuEntry) -> int:
        return entry.num_tokens

    def stored_bytes(self, entry: CpuEntry) -> int:
        return entry.nbytes

    def prepare(self, page: int, num_tokens: int) -> None:
        return None

    def admit(
        self, page: int, num_tokens: int, prepared: None, room: Callable[[int], int]
    ) -> CpuEntry:
        return CpuEntry(page, num_tokens, self._payload(num_tokens))

    def settle(self, page: int) -> None:
        return None  # the entry is the page: its reference is the entry's now

    def read_into(self, entry: CpuEntry, out: torch.Tensor) -> None:
        out[: entry.nbytes].copy_(self.holder.page_bytes_view(entry.page, entry.nbytes))
