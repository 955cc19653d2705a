"""What each group of a :class:`~kvtier.storage.tenants.local.TenantPolicy` holds, and the
scale of its guarantees.

A group is a row of the quota table (:meth:`~kvtier.storage.tenants.quotas.TenantQuotas.row_of`):
a tenant with a row of its own, or every salt under ``"*"`` together (None: the salts with no
row at all, which have no limit). The guarantees are scaled by the limits of the groups that
hold chunks::

    guarantee(g) = limit(g) x min(1, capacity / sum of limit(h) over the groups h holding chunks)

``"*"`` is in that sum once, however many salts it covers. Counted once per salt, a client
that stored one chunk under each of 200 salts added 200 times the row to the sum, and a named
tenant's 50 % guarantee shrank to 2.4 % of the tier (docs/tenants.md). The sums are kept as
chunks come and go, so an eviction adds nothing up (with thousands of salts a fresh sum cost
0.3 ms an eviction).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable


class GroupSums:
    """Chunks per group; the limits of the groups with a limit that hold chunks; their sum."""

    __slots__ = ("chunks", "limited", "total")

    def __init__(self) -> None:
        self.chunks: dict[str | None, int] = {}  # group -> chunks its tenants hold
        self.limited: dict[str, int] = {}  # group with a limit, holding chunks -> limit
        self.total = 0  # their sum: the guarantees' scale

    def add(self, group: str | None, delta: int, limit_of: Callable[[str], int]) -> None:
        """``group`` holds ``delta`` chunks more; ``limit_of(group)`` is read when it starts
        holding chunks (a group with no limit, None, is in no sum)."""
        chunks = self.chunks[group] = self.chunks.get(group, 0) + delta
        if group is None:
            return
        if chunks == 0:
            self.total -= self.limited.pop(group, 0)
        elif group not in self.limited:
            limit = self.limited[group] = limit_of(group)
            self.total += limit

    def held(self, group: str | None) -> int:
        return self.chunks.get(group, 0)

    def drop(self, group: str | None) -> None:
        """Forget ``group``, which holds nothing (its last tenant was forgotten)."""
        if not self.chunks.get(group):
            self.chunks.pop(group, None)

    def scale(self, capacity: int) -> float:
        """What every limit is multiplied by to make the guarantees now."""
        return min(1.0, capacity / self.total) if self.total else 1.0

    def guarantee(self, group: str, limit: int, capacity: int) -> float:
        """``group``'s guarantee, as if it held a chunk when it holds none (what it would get)."""
        total = self.total + (0 if group in self.limited else limit)
        return limit * min(1.0, capacity / total) if total else float(limit)

    def recount(
        self, held: Iterable[tuple[str | None, int]], limit_of: Callable[[str], int]
    ) -> None:
        """The sums afresh from (group, chunks) per tenant (the quota table changed)."""
        self.chunks = {}
        for group, chunks in held:
            self.chunks[group] = self.chunks.get(group, 0) + chunks
        self.limited = {
            group: limit_of(group)
            for group, chunks in self.chunks.items()
            if chunks and group is not None
        }
        self.total = sum(self.limited.values())
