"""The eviction policy seam: which cached chunk a tier drops, and which it declines to keep.

A tier owns its index (key -> where the bytes are) and every reference count; a policy owns
only an order over the keys the tier holds. The protocol, as the CPU tier drives it::

    tier.insert(key)      policy.admit(key, num_tokens) -> False: declined, nothing kept
                          (the policy may remember the key as a ghost, so that a second
                          use is admitted); True: the tier indexes it, then policy.insert(key)
                          (LRU and REUSE admit every chunk: docs/policies.md says why)
    tier lookup / hit     policy.touch(keys)       one batch per lookup, in prompt order
    tier.remove(key)      policy.remove(key)       the tier dropped it for its own reasons
    tier short of room    policy.evict(n, evictable) -> up to n keys, best victims first,
                          each one that ``evictable(key)`` allowed; the policy forgets them
                          and the tier drops them from its index
    first pin of key      policy.hold(key)         (a tier that sees every pin: the disk
    last pin of key gone  policy.restore(key)       index; optional, see below)

``evictable`` is the tier's answer to "does anyone besides the cache hold this chunk?" (a pin
by a request's lease, a write in flight): pins and reference counts stay with the page pool
and never reach the policy, as a page cache keeps them apart from its replacement order.

Held keys. A key someone holds must not cost every eviction a step (with 90 % of 100k keys
pinned, walking past them took ~50 ms per eviction under the tier's lock). So a held key
leaves the order: at ``hold(key)``, or the first time ``evictable`` refuses it (the CPU tier
cannot see its references go: leases give them back to the page pool directly). It comes
back at ``restore(key)``, or when an eviction finds it evictable again: each eviction looks
again at the :data:`RECHECKS_PER_VICTIM` longest-held keys per victim, and at all of them
before it would return fewer victims than asked (the path where nothing is evictable, which
walked every key before as well). So an eviction costs O(victims) however
many keys are held; a key is stepped over once per hold, not once per eviction; and a key
whose pin went rejoins within ``len(held) / RECHECKS_PER_VICTIM`` victims::

    order: [oldest ... newest]   --refused / hold-->   held: [longest held ... latest]
           ^ victims from here   <--evictable again / restore--   (rejoins as each policy says)

Held keys are cached keys: ``len``, ``in``, ``order()`` (last), ``remove`` and ``clear`` count
them; ``touch`` on one records the use without putting it back.

Keys are prefix-chained (``kvtier.keys``): chunk ``i`` is useful only while chunks ``0..i-1``
are cached, because a lookup stops at the first miss. A policy may use that (drop a child
before its parent) but must not rely on it for correctness.

Called under the tier's lock: a policy needs no lock of its own. ``touch`` is on the lookup
path of every request: implementations use C-level bulk operations (``map`` over the batch),
not a Python statement per key.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from itertools import repeat
from typing import ClassVar, Protocol

from kvtier.keys import ChunkKey

Evictable = Callable[[ChunkKey], bool]

# Held keys an eviction looks at again per victim it is asked for (see the module docstring):
# more brings a released key back sooner, at a constant cost per eviction either way.
RECHECKS_PER_VICTIM = 2


class PolicySeam(Protocol):
    """What a tier drives (the protocol above): an :class:`EvictionPolicy`, or a composite of
    one per group (:class:`~kvtier.storage.tenants.local.TenantPolicy`, ``tenant_quotas``)."""

    def admit(self, key: ChunkKey, num_tokens: int) -> bool: ...
    def insert(self, key: ChunkKey) -> None: ...
    def touch(self, keys: Sequence[ChunkKey]) -> None: ...
    def remove(self, key: ChunkKey) -> None: ...
    def hold(self, key: ChunkKey) -> None: ...
    def restore(self, key: ChunkKey) -> None: ...
    def evict(self, count: int, evictable: Evictable) -> list[ChunkKey]: ...
    def order(self) -> Iterator[ChunkKey]: ...
    def clear(self) -> None: ...
    def __len__(self) -> int: ...
    def __contains__(self, key: object) -> bool: ...
    @property
    def held(self) -> int: ...


class EvictionPolicy(ABC):
    name: ClassVar[str]

    def __init__(self) -> None:
        # Cached keys out of the order while held, longest held first (the recheck's order).
        self._held: OrderedDict[ChunkKey, None] = OrderedDict()

    @abstractmethod
    def admit(self, key: ChunkKey, num_tokens: int) -> bool:
        """Whether to keep ``key`` (not cached) at all. A declined key is not inserted."""

    @abstractmethod
    def insert(self, key: ChunkKey) -> None:
        """``key`` (admitted, not yet known to the policy) is now cached."""

    @abstractmethod
    def touch(self, keys: Sequence[ChunkKey]) -> None:
        """``keys`` (all cached) were used by one request, in prompt order."""

    @abstractmethod
    def remove(self, key: ChunkKey) -> None:
        """Forget ``key`` (cached, held or not: a no-op when unknown)."""

    @abstractmethod
    def _select(self, count: int, evictable: Evictable, refused: list[ChunkKey]) -> list[ChunkKey]:
        """Up to ``count`` victims from the order (not the held keys), best first, forgotten
        here. Walks the order only as far as it needs, appending each key ``evictable``
        refused to ``refused`` and leaving it in the order (the caller holds them)."""

    @abstractmethod
    def _leave(self, keys: Sequence[ChunkKey]) -> None:
        """Take ``keys`` (each in the order, once) out of it, keeping what each needs to be
        put back. In bulk: an eviction may find thousands of held keys at once."""

    @abstractmethod
    def _rejoin(self, key: ChunkKey) -> None:
        """Put back a key that was held (its holders gone), where the policy says."""

    @abstractmethod
    def order(self) -> Iterator[ChunkKey]:
        """Every cached key, the next victim first (for snapshots and tests); the held keys
        last, longest held first."""

    @abstractmethod
    def __len__(self) -> int:
        """Cached keys, held ones included."""

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    def hold(self, key: ChunkKey) -> None:
        """``key`` (cached) is held by someone besides the cache: out of the order until
        :meth:`restore`. A no-op when it is held already or not cached."""
        if key in self and key not in self._held:
            self._leave((key,))
            self._held[key] = None

    def restore(self, key: ChunkKey) -> None:
        """The last holder of ``key`` let go: it rejoins the order. A no-op unless held (so a
        second release, or one for a key evicted or removed meanwhile, changes nothing)."""
        if self._held.pop(key, 0) is None:
            self._rejoin(key)

    def evict(self, count: int, evictable: Evictable) -> list[ChunkKey]:
        """Up to ``count`` victims among the keys ``evictable`` allows, best first; they are
        forgotten here and must be dropped by the tier. Fewer only when fewer are evictable.
        A key ``evictable`` refuses is held (see the module docstring)."""
        if count <= 0:
            return []
        self._recheck(RECHECKS_PER_VICTIM * count, evictable)
        victims = self._select_holding_refused(count, evictable)
        if len(victims) < count and self._held:  # short: every held key once more
            self._recheck(len(self._held), evictable)
            victims += self._select_holding_refused(count - len(victims), evictable)
        return victims

    def _select_holding_refused(self, count: int, evictable: Evictable) -> list[ChunkKey]:
        refused: list[ChunkKey] = []
        victims = self._select(count, evictable, refused)
        if refused:  # after the walk: the order must not change under it
            self._leave(refused)
            self._held.update(zip(refused, repeat(None)))  # C-level (a dict argument is slow)
        return victims

    def _recheck(self, limit: int, evictable: Evictable) -> None:
        """Look at up to ``limit`` longest-held keys: those evictable now rejoin the order,
        the others go to the back of the held keys."""
        held = self._held
        for _ in range(min(limit, len(held))):
            key, _none = held.popitem(last=False)
            if evictable(key):
                self._rejoin(key)
            else:
                held[key] = None

    def is_held(self, key: ChunkKey) -> bool:
        """Whether ``key`` is out of the order, held (see :meth:`hold`)."""
        return key in self._held

    @property
    def held(self) -> int:
        """How many cached keys are out of the order (held)."""
        return len(self._held)

    def clear(self) -> None:
        """Forget every key (held keys and ghosts too)."""
        for key in list(self.order()):
            self.remove(key)
