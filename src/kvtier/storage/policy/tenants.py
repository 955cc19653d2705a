"""Per-tenant quotas as an eviction policy: one order per tenant, victims by who is most over.

With ``tenant_quotas`` set (:mod:`kvtier.config.tenant_quotas`), a tier's policy is a
:class:`TenantPolicy`: it keeps, for each tenant with a limit, an eviction policy of its own
(``cache_policy``'s, as LMCache isolates each ``cache_salt`` in an LRU of its own), one
shared policy for the tenants with none, and what each tenant holds. A tenant is a request's
``cache_salt`` ("" for none); the tier names a key's tenant with :meth:`assign` just before it
inserts the key (the store path carries it there; every other call is the plain
:class:`~kvtier.storage.policy.base.EvictionPolicy` seam, so the tier's code is unchanged).

Accounting is in whole chunks of the tier's ``unit_bytes`` (a CPU page; a disk file of a
whole chunk), so a tenant's bytes held are its chunks times the unit, never negative, and
exact for every full chunk (a partial chunk counts as a whole one: a tenant is charged at
most a chunk's rounding per partial chunk, never less than it holds)::

    limit(t)      its row's bytes, or its share of the tier's capacity_bytes (None: no row)
    guarantee(t)  limit(t) x min(1, capacity / sum of the limits of the tenants held)
    excess(t)     held(t) - guarantee(t)           (a tenant with no limit: guarantee 0)

Rules, in the order the tier applies them:

1. After it inserts a chunk of tenant t, while held(t) > limit(t) the tier evicts t's own
   victims (:meth:`evict_over_quota`, counted as quota evictions: ``kvtier explain`` names
   a later miss on one). Pinned chunks are never victims, so a tenant may stay above its
   limit by what it has pinned, no further.
2. When the tier is short of room (:meth:`evict`), each victim comes from the tenant with
   the largest excess that has an evictable chunk. A tenant at or under its guarantee is
   evicted by others only when no tenant is over its own (the tier's room then went to pages
   that are not cached chunks: pins, writes in flight), so under its guarantee it keeps its
   chunks whatever another tenant stores, while its chunks come back.
3. A tenant whose chunks do not come back (:mod:`~kvtier.storage.policy.tenant_reuse`: it
   lost a guarantee's worth of chunks in a row, none of them used or asked for again) has
   its guarantee lapse: its chunks that were never hit are the first victims of rule 2,
   before any other tenant's, until one of its chunks comes back. A scanner's quota then
   caps it without taking room from the tenants that reuse theirs, and it keeps the chunks
   it does use (a system prompt every scan shares).

Limits are read from the shared :class:`~kvtier.storage.policy.quotas.TenantQuotas` on every
decision; when a row changes, the tier calls :meth:`regroup` (a tenant that gained or lost
its row moves between its own order and the shared one, in order) and then rule 1 per tenant.
Costs: one dict lookup per key inserted, touched or removed, and O(tenants) per victim.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import chain, groupby

from kvtier.keys import ChunkKey
from kvtier.storage.policy.base import Evictable, EvictionPolicy
from kvtier.storage.policy.quotas import TenantQuotas
from kvtier.storage.policy.tenant_reuse import ReuseWatch, ReuseWatches

NO_SALT = ""  # the tenant of requests without a cache_salt
_SHARED = None  # the group of every tenant with no limit: one order among them
QUOTA_EVICTIONS_KEPT = 65536  # keys remembered as evicted by their tenant's quota (explain)
ASSIGNED_KEPT = 65536  # assigned keys not inserted yet (a write that failed never is)
# Tenants remembered (their counters: stats and metrics): past this many, a tenant that
# holds nothing more is forgotten (a salt per user must not grow the tier without bound).
TENANTS_KEPT = 4096


@dataclass(slots=True)
class TenantUsage:
    """One tenant in one tier: chunks held (bytes = chunks x unit), hits, evictions."""

    chunks: int = 0
    hits: int = 0
    evictions: int = 0  # every eviction of its chunks, quota evictions included
    quota_evictions: int = 0  # by rule 1: it was over its own limit


class TenantPolicy(EvictionPolicy):
    name = "tenants"

    def __init__(
        self,
        make_policy: Callable[[], EvictionPolicy],
        quotas: TenantQuotas,
        unit_bytes: int,
        capacity_bytes: int,
    ) -> None:
        super().__init__()
        self._make = make_policy
        self.quotas = quotas
        self.unit_bytes = unit_bytes
        self.capacity_bytes = capacity_bytes
        self._tenant_of: dict[ChunkKey, str] = {}
        self._groups: dict[str | None, EvictionPolicy] = {}
        self._group_of_tenant: dict[str, str | None] = {}
        self._next: dict[ChunkKey, str] = {}  # assigned, not yet inserted
        self.usage: dict[str, TenantUsage] = {}
        self.quota_evicted: OrderedDict[ChunkKey, str] = OrderedDict()
        # Kept as chunks come and go, so an eviction reads no tenant that holds nothing and
        # sums no limits (with thousands of salts that cost 0.3 ms an eviction):
        self._limited: dict[str, int] = {}  # tenant with a limit, holding chunks -> limit
        self._limits_total = 0  # their sum: the guarantees' scale
        self._shared_chunks = 0  # chunks of the tenants with no limit
        self._watch = ReuseWatches()  # of the tenants with a limit: do their chunks return

    # -- tenants ---------------------------------------------------------------------------
    def assign(self, key: ChunkKey, tenant: str | None) -> None:
        """The next :meth:`insert` (or :meth:`admit`) of ``key`` is ``tenant``'s. The oldest
        of more than :data:`ASSIGNED_KEPT` pending go (their writes failed or were refused)."""
        pending = self._next
        pending[key] = tenant or NO_SALT
        if len(pending) > ASSIGNED_KEPT:
            del pending[next(iter(pending))]

    def expect(self, tenants: dict[ChunkKey, str]) -> None:
        """Assign many keys at once (a restart naming its files' tenants), unbounded until
        :meth:`forget_expected` after the index is built."""
        self._next.update(tenants)

    def forget_expected(self) -> None:
        self._next.clear()

    def unassign(self, key: ChunkKey) -> None:
        """``key`` was assigned but will not be inserted (its write failed)."""
        self._next.pop(key, None)

    def tenant_of(self, key: ChunkKey) -> str | None:
        return self._tenant_of.get(key)

    def held_bytes(self, tenant: str) -> int:
        usage = self.usage.get(tenant)
        return usage.chunks * self.unit_bytes if usage is not None else 0

    def limit_bytes(self, tenant: str) -> int | None:
        limit = self.quotas.limit(tenant)
        return None if limit is None else limit.bytes_of(self.capacity_bytes)

    def guarantee_bytes(self, tenant: str) -> float:
        limit = self.limit_bytes(tenant)
        if limit is None:
            return 0.0
        total = self._limits_total + (0 if tenant in self._limited else limit)
        return limit * min(1.0, self.capacity_bytes / total) if total else float(limit)

    def _count(self, tenant: str, usage: TenantUsage, delta: int) -> None:
        """``tenant`` holds ``delta`` chunks more (the only place chunk counts change)."""
        usage.chunks += delta
        if self._group_of_tenant.get(tenant) is _SHARED:
            self._shared_chunks += delta
        elif usage.chunks == 0:
            self._limits_total -= self._limited.pop(tenant, 0)
        elif tenant not in self._limited:
            limit = self.limit_bytes(tenant) or 0
            self._limited[tenant] = limit
            self._limits_total += limit
        if usage.chunks == 0 and len(self.usage) > TENANTS_KEPT:
            self._forget_tenant(tenant)

    def _forget_tenant(self, tenant: str) -> None:
        """``tenant`` holds nothing: drop its counters and its (empty) order."""
        del self.usage[tenant]
        self._watch.forget(tenant)
        name = self._group_of_tenant.pop(tenant, _SHARED)
        if name is not _SHARED and not len(self._groups[name]):
            del self._groups[name]

    def _recount(self) -> None:
        """The kept sums afresh (the quota table changed)."""
        self._limited = {}
        self._shared_chunks = 0
        for tenant, usage in self.usage.items():
            if usage.chunks and self._group_of_tenant.get(tenant) is _SHARED:
                self._shared_chunks += usage.chunks
            elif usage.chunks:
                self._limited[tenant] = self.limit_bytes(tenant) or 0
        self._limits_total = sum(self._limited.values())

    def guarantee_held(self, tenant: str) -> bool:
        """Whether ``tenant``'s guarantee holds now: it has a limit and has not lapsed."""
        watch = self._watch.get(tenant)
        return self.limit_bytes(tenant) is not None and (watch is None or not watch.lapsed)

    def over_quota(self, tenant: str) -> bool:
        limit = self.limit_bytes(tenant)
        return limit is not None and self.held_bytes(tenant) > limit

    def _group(self, tenant: str) -> EvictionPolicy:
        name = self._group_of_tenant.get(tenant, 0)
        if name == 0:
            name = self._group_of_tenant[tenant] = (
                tenant if self.quotas.limit(tenant) is not None else _SHARED
            )
        group = self._groups.get(name)  # type: ignore[arg-type]
        if group is None:
            group = self._groups[name] = self._make()  # type: ignore[index]
        return group

    # -- the EvictionPolicy seam -----------------------------------------------------------
    def admit(self, key: ChunkKey, num_tokens: int) -> bool:
        return self._group(self._next.get(key, NO_SALT)).admit(key, num_tokens)

    def insert(self, key: ChunkKey) -> None:
        tenant = self._next.pop(key, NO_SALT)
        self._group(tenant).insert(key)
        self._tenant_of[key] = tenant
        usage = self.usage.get(tenant)
        if usage is None:
            usage = self.usage[tenant] = TenantUsage()
        self._count(tenant, usage, 1)
        self.quota_evicted.pop(key, None)
        if self._group_of_tenant[tenant] is not _SHARED:
            self._watch.stored(tenant, key)

    def touch(self, keys: Sequence[ChunkKey]) -> None:
        tenant_of = self._tenant_of.get
        for tenant, run in groupby(keys, tenant_of):  # a prompt's keys are one tenant's
            if tenant is None:
                continue
            batch = list(run)
            self._group(tenant).touch(batch)
            self.usage[tenant].hits += len(batch)
            self._watch.hit(tenant, batch)

    def remove(self, key: ChunkKey) -> None:
        tenant = self._tenant_of.pop(key, None)
        if tenant is not None:
            self._group(tenant).remove(key)
            self._count(tenant, self.usage[tenant], -1)
            self._watch.removed(tenant, key)

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
        docstring): a tenant with a limit is a group; the shared group's excess is all it
        holds. O(tenants) per call, and O(groups) more per victim."""
        total = self._limits_total
        scale = min(1.0, self.capacity_bytes / total) if total else 1.0
        unit, usage = self.unit_bytes, self.usage
        excess: dict[str | None, float] = {
            tenant: usage[tenant].chunks * unit - limit * scale
            for tenant, limit in self._limited.items()
        }
        for tenant in self._watch.lapsed.intersection(excess):
            excess[tenant] = self._excess(tenant, scale)
        if self._shared_chunks:
            excess[_SHARED] = self._shared_chunks * unit
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
        """The watch of tenant ``name`` while rule 3 takes its victims first: its guarantee
        lapsed and it holds chunks never hit."""
        if name is _SHARED or name not in self._watch.lapsed:
            return None
        watch = self._watch.get(name)
        return watch if watch is not None and self.usage[name].chunks > watch.used_held else None

    def _excess(self, name: str | None, scale: float) -> float:
        """What group ``name`` holds past its guarantee (-inf: nothing); a lapsed tenant's
        chunks never hit come ahead of every other tenant (no excess reaches the capacity)."""
        unit = self.unit_bytes
        if name is _SHARED:
            return self._shared_chunks * unit if self._shared_chunks else float("-inf")
        chunks = self.usage[name].chunks if name in self.usage else 0
        if not chunks:
            return float("-inf")
        lapsed = self._lapsed(name)
        if lapsed is not None:
            return (chunks - lapsed.used_held) * unit + self.capacity_bytes
        return chunks * unit - self._limited.get(name, 0) * scale

    def evict_over_quota(self, tenant: str, evictable: Evictable) -> list[ChunkKey]:
        """Rule 1: ``tenant``'s own victims until it is within its limit (or only pinned
        chunks are left); the tier drops them. A tenant with a limit has an order of its own."""
        victims: list[ChunkKey] = []
        while self.over_quota(tenant):
            found = self._group(tenant).evict(1, evictable)
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
        self._watch.lost(tenant, key, int(self.guarantee_bytes(tenant)) // self.unit_bytes)
        if quota:
            usage.quota_evictions += 1
            self.quota_evicted[key] = tenant
            if len(self.quota_evicted) > QUOTA_EVICTIONS_KEPT:
                self.quota_evicted.popitem(last=False)

    def regroup(self) -> None:
        """The quota table changed: each tenant whose group changed (it gained or lost its
        row) moves there, its keys in their order, held keys held again (one walk of each
        group left), and the kept sums are made afresh."""
        moving: dict[str, str | None] = {}  # tenant -> its old group
        for tenant, old_name in self._group_of_tenant.items():
            new_name = tenant if self.quotas.limit(tenant) is not None else _SHARED
            if new_name != old_name:
                moving[tenant] = old_name
                self._group_of_tenant[tenant] = new_name
                if new_name is _SHARED:
                    self._watch.forget(tenant)
        for old_name in set(moving.values()):
            old = self._groups.get(old_name)
            if old is None:
                continue
            tenant_of = self._tenant_of.get
            keys = [k for k in old.order() if moving.get(tenant_of(k) or "", 0) == old_name]
            for key in keys:
                was_held = key in old._held
                old.remove(key)
                new = self._group(self._tenant_of[key])
                new.insert(key)
                if was_held:
                    new.hold(key)
            if old_name is not _SHARED and not len(old):
                del self._groups[old_name]
        self._recount()

    def evicted_by_quota(self, keys: Sequence[ChunkKey]) -> dict[ChunkKey, str]:
        """Of ``keys``, those rule 1 evicted (the last :data:`QUOTA_EVICTIONS_KEPT`), with
        their tenant. C-level lookups: a plain ``dict.get`` per key, no lock needed."""
        found = map(self.quota_evicted.get, keys)
        return {k: t for k, t in zip(keys, found, strict=True) if t is not None}

    def report(self) -> dict[str, dict[str, int | None]]:
        """Per tenant: bytes held, its limit and the guarantee it has now (None: no limit;
        0: lapsed, rule 3), chunks, hits, evictions and quota evictions (``stats()`` and the
        Prometheus metrics read these names)."""
        return {
            tenant: {
                "held_bytes": usage.chunks * self.unit_bytes,
                "limit_bytes": self.limit_bytes(tenant),
                "guarantee_bytes": self._guarantee_now(tenant),
                "chunks": usage.chunks,
                "hits": usage.hits,
                "evictions": usage.evictions,
                "quota_evictions": usage.quota_evictions,
            }
            for tenant, usage in self.usage.items()
        }

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

    # The base class's order machinery is each group's; this policy never walks one itself.
    def _select(self, count: int, evictable: Evictable, refused: list[ChunkKey]) -> list[ChunkKey]:
        raise AssertionError("TenantPolicy selects through its groups")

    def _leave(self, keys: Sequence[ChunkKey]) -> None:
        raise AssertionError("TenantPolicy's groups hold their own keys")

    def _rejoin(self, key: ChunkKey) -> None:
        raise AssertionError("TenantPolicy's groups hold their own keys")
