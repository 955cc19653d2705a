"""The ledger of a tier that holds every chunk (CPU, disk): one order per row, victims by
who is most over.

With ``tenant_quotas`` set (:mod:`kvtier.config.tenant_quotas`), the CPU and disk tiers drive
a :class:`TenantPolicy`, a *composite* over the eviction policy (not a kind of it): it keeps
an eviction policy (``cache_policy``'s) per *group*, what each tenant holds, and answers both
the policy seam (:class:`~kvtier.storage.policy.base.PolicySeam`, what the tier drives) and
the ledger protocol (:class:`~kvtier.storage.tenants.ledger.TenantLedger`).

A tenant with a row of its own is a group (as LMCache isolates each ``cache_salt`` in an LRU
of its own); every salt the table does not name is in the ``"*"``
row's one group, one limit and one guarantee for all of them (vLLM takes ``cache_salt`` from
each request: a client spraying salts claims the row once, not once per salt); without
``"*"`` they share one group with no limit. A tenant is a request's ``cache_salt`` ("" for
none). The CPU tier, which has the put's tenant in hand, admits with :meth:`admit_as` and
inserts with :meth:`charge`; the disk tier, whose index inserts when a write lands (or a
restart finds its files), names the tenant first (:meth:`expect`) and calls :meth:`charge`
once the file landed. Every other call is the plain seam, passed to the key's group.

Accounting is in whole chunks of the tier's ``unit_bytes`` (a CPU page; a disk file of a
whole chunk), so a tenant's bytes held are its chunks times the unit, never negative, and
exact for every full chunk (a partial chunk counts as a whole one: a tenant is charged at
most a chunk's rounding per partial chunk, never less than it holds)::

    g             a group: a named tenant, or every salt under "*" together
    held(g)       the chunks of its tenants
    limit(g)      its row's bytes, or its share of the tier's capacity_bytes (None: no row)
    guarantee(g)  limit(g) x min(1, capacity / sum of the limits of the groups held)
    excess(g)     held(g) - guarantee(g)           (a group with no limit: guarantee 0)

(:mod:`~kvtier.storage.tenants.groups` keeps the sums: "*" counts once in them.)

A tenant's limit and guarantee are its group's (shared, under "*"); its held bytes its own.

Rules, in the order the tier applies them:

1. After it inserts a chunk of tenant t, while t's group is over its limit the tier evicts
   the group's own victims (:meth:`charge` returns them; under "*", any unnamed salt's; counted
   as quota evictions: ``kvtier explain`` names a later miss on one). Pinned chunks are
   never victims, so a group may stay above its limit by what it has pinned, no further.
2. When the tier is short of room (:meth:`evict`), each victim comes from the group with
   the largest excess that has an evictable chunk. A group at or under its guarantee is
   evicted by others only when no group is over its own (the tier's room then went to pages
   that are not cached chunks: pins, writes in flight), so under its guarantee it keeps its
   chunks whatever another tenant stores, while its chunks come back.
3. A group whose chunks do not come back (:mod:`~kvtier.storage.tenants.reuse`: it
   lost a guarantee's worth of chunks in a row, none of them used or asked for again) has
   its guarantee lapse: its chunks that were never hit are the first victims of rule 2,
   before any other group's, until one of its chunks comes back. A scanner's quota then
   caps it without taking room from the tenants that reuse theirs, and it keeps the chunks
   it does use (a system prompt every scan shares).

Limits are read from the shared :class:`~kvtier.storage.tenants.quotas.TenantQuotas` on every
decision; when a row changes, the tier calls :meth:`regroup` (a tenant that gained or lost
its row moves between its own order and a shared one, in order; rule 1 per tenant follows).
Costs: one dict lookup per key inserted, touched or removed, and O(groups) per victim.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from itertools import chain, groupby

from kvtier.keys import ChunkKey
from kvtier.storage.policy.base import Evictable, EvictionPolicy
from kvtier.storage.tenants.groups import GroupSums
from kvtier.storage.tenants.ledger import ASSIGNED_KEPT, NO_SALT, TENANTS_KEPT, QuotaEvictions
from kvtier.storage.tenants.quotas import TenantQuotas
from kvtier.storage.tenants.reuse import ReuseWatch, ReuseWatches
from kvtier.storage.tenants.rows import TenantRow

_SHARED = None  # the group of every tenant with no limit (no "*" row): one order among them


def _nothing_evictable(key: ChunkKey) -> bool:
    return False


@dataclass(slots=True)
class TenantUsage:
    """One tenant in one tier: chunks held (bytes = chunks x unit), hits, evictions."""

    chunks: int = 0
    hits: int = 0
    evictions: int = 0  # every eviction of its chunks, quota evictions included
    quota_evictions: int = 0  # by rule 1: it was over its own limit


class TenantPolicy:
    """A composite over ``make_policy()`` orders, one per group (module docstring). Not
    thread-safe: the tier calls it under its lock, and :meth:`bind` hands it that lock (which
    :meth:`rows` takes, as readers call it from any thread) and the tier's answer to "may
    this key go now" for the victims :meth:`charge` takes (until then a charge takes none)."""

    name = "tenants"

    def __init__(
        self,
        make_policy: Callable[[], EvictionPolicy],
        quotas: TenantQuotas,
        unit_bytes: int,
        capacity_bytes: int,
    ) -> None:
        self._make = make_policy
        self.evictable: Evictable = _nothing_evictable
        self._lock: AbstractContextManager[object] = nullcontext()
        self.quotas = quotas
        self.unit_bytes = unit_bytes
        self.capacity_bytes = capacity_bytes
        self._tenant_of: dict[ChunkKey, str] = {}
        self._groups: dict[str | None, EvictionPolicy] = {}  # by row ("*": unnamed salts)
        self._group_of_tenant: dict[str, str | None] = {}
        self._next: dict[ChunkKey, str] = {}  # named (expect), not yet inserted
        self.usage: dict[str, TenantUsage] = {}
        self._quota_evicted = QuotaEvictions()
        self._sums = GroupSums()  # chunks per group, and the guarantees' scale
        self._watch = ReuseWatches()  # of the groups with a limit: do their chunks return

    def bind(self, evictable: Evictable, lock: AbstractContextManager[object]) -> None:
        """The tier that drives this ledger, once, as it is built: its evictable test and
        the lock it calls under."""
        self.evictable, self._lock = evictable, lock

    # -- tenants ---------------------------------------------------------------------------
    def expect(self, key: ChunkKey, tenant: str) -> None:
        """The next :meth:`insert` of ``key`` (a write landing in the disk index) is
        ``tenant``'s. The oldest of more than :data:`ASSIGNED_KEPT` pending go (their writes
        failed or were refused)."""
        pending = self._next
        pending[key] = tenant
        if len(pending) > ASSIGNED_KEPT:
            del pending[next(iter(pending))]

    def expect_many(self, tenants: dict[ChunkKey, str]) -> None:
        """Name many keys' tenants at once (a restart naming its files' tenants), unbounded
        until :meth:`forget_expected` after the index is built."""
        self._next.update(tenants)

    def forget_expected(self, key: ChunkKey | None = None) -> None:
        """``key`` (None: every key) was named but will not be inserted."""
        if key is None:
            self._next.clear()
        else:
            self._next.pop(key, None)

    def tenant_of(self, key: ChunkKey) -> str | None:
        return self._tenant_of.get(key)

    def held_bytes(self, tenant: str) -> int:
        usage = self.usage.get(tenant)
        return usage.chunks * self.unit_bytes if usage is not None else 0

    def limit_bytes(self, tenant: str) -> int | None:
        """``tenant``'s group's limit (under ``"*"``: what all unnamed salts share)."""
        limit = self.quotas.limit(tenant)
        return None if limit is None else limit.bytes_of(self.capacity_bytes)

    def guarantee_bytes(self, tenant: str) -> float:
        """``tenant``'s group's guarantee (module docstring; shared under ``"*"``)."""
        limit = self.limit_bytes(tenant)
        if limit is None:
            return 0.0
        return self._sums.guarantee(self._name(tenant) or "", limit, self.capacity_bytes)

    def _row_bytes(self, row: str) -> int:
        return self.limit_bytes(row) or 0  # a row's name is a tenant it is the row of

    def _name(self, tenant: str) -> str | None:
        """The group ``tenant`` is counted in: its row's name (None: no limit)."""
        name = self._group_of_tenant.get(tenant, 0)
        if name == 0:
            name = self._group_of_tenant[tenant] = self.quotas.row_of(tenant)
        return name  # type: ignore[return-value]

    def _count(self, tenant: str, usage: TenantUsage, delta: int) -> None:
        """``tenant`` holds ``delta`` chunks more (the only place chunk counts change)."""
        usage.chunks += delta
        self._sums.add(self._name(tenant), delta, self._row_bytes)
        if usage.chunks == 0 and len(self.usage) > TENANTS_KEPT:
            self._forget_tenant(tenant)

    def _forget_tenant(self, tenant: str) -> None:
        """``tenant`` holds nothing: drop its counters, and its group's (empty) order and
        watch when no other tenant holds a chunk there."""
        del self.usage[tenant]
        name = self._group_of_tenant.pop(tenant, _SHARED)
        if name is not _SHARED and not self._sums.held(name):
            self._watch.forget(name)
            self._sums.drop(name)
            self._groups.pop(name, None)  # another salt of "*" may have dropped it already

    def _recount(self) -> None:
        """The kept sums afresh (the quota table changed)."""
        held = [(self._name(tenant), usage.chunks) for tenant, usage in self.usage.items()]
        self._sums.recount(held, self._row_bytes)

    def guarantee_held(self, tenant: str) -> bool:
        """Whether ``tenant``'s guarantee holds now: it has a limit and has not lapsed."""
        name = self._name(tenant)
        watch = self._watch.get(name) if name is not _SHARED else None
        return self.limit_bytes(tenant) is not None and (watch is None or not watch.lapsed)

    def over_quota(self, tenant: str) -> bool:
        """Whether ``tenant``'s group holds more than its limit."""
        limit = self.limit_bytes(tenant)
        return limit is not None and self._sums.held(self._name(tenant)) * self.unit_bytes > limit

    def _group(self, tenant: str) -> EvictionPolicy:
        name = self._name(tenant)
        group = self._groups.get(name)
        if group is None:
            group = self._groups[name] = self._make()
        return group

    # -- the ledger protocol (kvtier.storage.tenants.ledger) -------------------------------
    def admit_as(self, key: ChunkKey, num_tokens: int, tenant: str) -> bool:
        """Whether ``tenant``'s group keeps ``key`` at all (its policy's ``admit``)."""
        return self._group(tenant).admit(key, num_tokens)

    def charge(self, key: ChunkKey, tenant: str) -> list[ChunkKey]:
        """``key`` is ``tenant``'s and cached: into its group's order (unless the disk index
        inserted it already, as :meth:`expect` named it), then rule 1: the group's own
        victims while it is over its limit, forgotten here, for the tier to drop."""
        if key not in self._tenant_of:
            self._insert_as(key, tenant)
        return self.enforce(self._tenant_of[key])

    def enforce(self, tenant: str) -> list[ChunkKey]:
        """Rule 1 alone: ``tenant``'s group's own victims while it is over its limit (a store
        let go of its new chunks' pages, which no eviction could take while it held them)."""
        return self._over_quota_victims(tenant) if self.over_quota(tenant) else []

    def release(self, key: ChunkKey) -> None:
        self.remove(key)

    def evicted_by_quota(self, keys: Sequence[ChunkKey]) -> dict[ChunkKey, str]:
        """Of ``keys``, those rule 1 evicted (the last ``QUOTA_EVICTIONS_KEPT``), with their
        tenant. C-level lookups: a plain ``dict.get`` per key, no lock needed."""
        return self._quota_evicted.among(keys)

    def rows(self) -> list[TenantRow]:
        """Per tenant: bytes held, its limit and the guarantee it has now (None: no limit;
        0: lapsed, rule 3), chunks, hits, evictions and quota evictions."""
        with self._lock:
            return self._rows()

    def _rows(self) -> list[TenantRow]:
        return [
            TenantRow(
                tenant,
                held_bytes=usage.chunks * self.unit_bytes,
                limit_bytes=self.limit_bytes(tenant),
                guarantee_bytes=self._guarantee_now(tenant),
                chunks=usage.chunks,
                hits=usage.hits,
                evictions=usage.evictions,
                quota_evictions=usage.quota_evictions,
            )
            for tenant, usage in self.usage.items()
        ]

    # -- the policy seam (kvtier.storage.policy.base.PolicySeam) ---------------------------
    def admit(self, key: ChunkKey, num_tokens: int) -> bool:
        return self._group(self._next.get(key, NO_SALT)).admit(key, num_tokens)

    def insert(self, key: ChunkKey) -> None:
        """``key`` is cached, the tenant :meth:`expect` named (else the unsalted tenant's)."""
        self._insert_as(key, self._next.pop(key, NO_SALT))

    def _insert_as(self, key: ChunkKey, tenant: str) -> None:
        self._group(tenant).insert(key)
        self._tenant_of[key] = tenant
        usage = self.usage.get(tenant)
        if usage is None:
            usage = self.usage[tenant] = TenantUsage()
        self._count(tenant, usage, 1)
        self._quota_evicted.forget(key)
        name = self._group_of_tenant[tenant]
        if name is not _SHARED:
            self._watch.stored(name, key)

    def touch(self, keys: Sequence[ChunkKey]) -> None:
        tenant_of = self._tenant_of.get
        for tenant, run in groupby(keys, tenant_of):  # a prompt's keys are one tenant's
            if tenant is None:
                continue
            batch = list(run)
            self._group(tenant).touch(batch)
            self.usage[tenant].hits += len(batch)
            self._watch.hit(self._name(tenant), batch)

    def remove(self, key: ChunkKey) -> None:
        tenant = self._tenant_of.pop(key, None)
        if tenant is not None:
            self._group(tenant).remove(key)
            self._count(tenant, self.usage[tenant], -1)
            self._watch.removed(self._name(tenant), key)

    def hold(self, key: ChunkKey) -> None:
        tenant = self._tenant_of.get(key)
        if tenant is not None:
            self._group(tenant).hold(key)

    def restore(self, key: ChunkKey) -> None:
        tenant = self._tenant_of.get(key)
        if tenant is not None:
            self._group(tenant).restore(key)

    def evict(self, count: int, evictable: Evictable) -> list[ChunkKey]:
        """Rules 2 and 3: each victim from the group most over its guarantee (module
        docstring); the group with no limit's excess is all it holds. O(groups) per call,
        and O(groups) more per victim."""
        scale = self._sums.scale(self.capacity_bytes)
        unit, chunks = self.unit_bytes, self._sums.chunks
        excess: dict[str | None, float] = {
            row: chunks[row] * unit - limit * scale for row, limit in self._sums.limited.items()
        }
        for row in self._watch.lapsed.intersection(excess):
            excess[row] = self._excess(row, scale)
        if chunks.get(_SHARED):
            excess[_SHARED] = chunks[_SHARED] * unit
        victims: list[ChunkKey] = []
        while len(victims) < count and excess:
            name = max(excess, key=excess.__getitem__)
            group = self._groups.get(name)
            lapsed = self._lapsed(name)
            allowed = evictable if lapsed is None else lapsed.unused_among(evictable)
            found = group.evict(1, allowed) if group is not None else []
            if not found:
                del excess[name]  # nothing evictable there: the next most over
                continue
            self._forget(found[0], quota=False)
            victims.append(found[0])
            excess[name] = self._excess(name, scale)
        return victims

    def _lapsed(self, name: str | None) -> ReuseWatch | None:
        """The watch of group ``name`` while rule 3 takes its victims first: its guarantee
        lapsed and it holds chunks never hit."""
        if name is _SHARED or name not in self._watch.lapsed:
            return None
        watch = self._watch.get(name)
        held = self._sums.held(name)
        return watch if watch is not None and held > watch.used_held else None

    def _excess(self, name: str | None, scale: float) -> float:
        """What group ``name`` holds past its guarantee (-inf: nothing); a lapsed tenant's
        chunks never hit come ahead of every other tenant (no excess reaches the capacity)."""
        unit = self.unit_bytes
        chunks = self._sums.held(name)
        if not chunks:
            return float("-inf")
        if name is _SHARED:
            return chunks * unit
        lapsed = self._lapsed(name)
        if lapsed is not None:
            return (chunks - lapsed.used_held) * unit + self.capacity_bytes
        return chunks * unit - self._sums.limited.get(name or "", 0) * scale

    def _over_quota_victims(self, tenant: str) -> list[ChunkKey]:
        """Rule 1: victims of ``tenant``'s group until it is within its limit (or only chunks
        :attr:`evictable` refuses are left); the tier drops them. A group with a limit has an
        order of its own (under ``"*"``, one order of every unnamed salt's chunks)."""
        victims: list[ChunkKey] = []
        while self.over_quota(tenant):
            found = self._group(tenant).evict(1, self.evictable)
            if not found:
                break
            self._forget(found[0], quota=True)
            victims.append(found[0])
        return victims

    def _forget(self, key: ChunkKey, *, quota: bool) -> None:
        tenant = self._tenant_of.pop(key)
        usage = self.usage[tenant]
        self._count(tenant, usage, -1)
        usage.evictions += 1
        guarantee = int(self.guarantee_bytes(tenant)) // self.unit_bytes
        self._watch.lost(self._name(tenant), key, guarantee)
        if quota:
            usage.quota_evictions += 1
            self._quota_evicted.record(key, tenant)

    def regroup(self) -> list[ChunkKey]:
        """The quota table changed: each tenant whose group changed (it gained or lost its
        row, or "*" came or went) moves there, its keys in their order, held keys held again
        (one walk of each group left), and the kept sums are made afresh; then rule 1 for
        every tenant. Returns its victims, for the tier to drop."""
        moving: dict[str, str | None] = {}  # tenant -> its old group
        for tenant, old_name in self._group_of_tenant.items():
            new_name = self.quotas.row_of(tenant)
            if new_name != old_name:
                moving[tenant] = old_name
                self._group_of_tenant[tenant] = new_name
        for old_name in set(moving.values()):
            old = self._groups.get(old_name)
            if old is None:
                continue
            tenant_of = self._tenant_of.get
            keys = [k for k in old.order() if moving.get(tenant_of(k) or "", 0) == old_name]
            for key in keys:
                was_held = old.is_held(key)
                old.remove(key)
                self._watch.removed(old_name, key)  # its hits speak no more for the old group
                new = self._group(self._tenant_of[key])
                new.insert(key)
                if was_held:
                    new.hold(key)
            if old_name is not _SHARED and not len(old):
                del self._groups[old_name]
        self._watch.keep_only(set(self._group_of_tenant.values()))
        self._recount()
        victims: list[ChunkKey] = []
        for tenant in list(self.usage):
            if self.over_quota(tenant):
                victims += self._over_quota_victims(tenant)
        return victims

    def order(self) -> Iterator[ChunkKey]:
        """Each group's order in turn (victims come by excess, not by one order)."""
        return chain.from_iterable(group.order() for group in list(self._groups.values()))

    def __len__(self) -> int:
        return len(self._tenant_of)

    def __contains__(self, key: object) -> bool:
        return key in self._tenant_of

    @property
    def held(self) -> int:
        return sum(group.held for group in self._groups.values())

    def _guarantee_now(self, tenant: str) -> int | None:
        if self.limit_bytes(tenant) is None:
            return None
        return int(self.guarantee_bytes(tenant)) if self.guarantee_held(tenant) else 0

    def clear(self) -> None:
        for group in self._groups.values():
            group.clear()
        self._watch.clear()
        self._tenant_of.clear()
        for usage in self.usage.values():
            usage.chunks = 0
        self._recount()
