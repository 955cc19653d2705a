"""The disk tier's in-memory index: which chunk files exist, their eviction order, their pins.

The index is the only state the disk tier keeps besides the files themselves. It is rebuilt
at every open from the files (a clean close saves it, :mod:`kvtier.storage.disk.snapshot`,
so that a restart reads the headers of only the files it does not name).

Capacity accounting counts whole files (header + payload), because that is what the disk
holds. A write first *reserves* its bytes (evicting least recently used, unpinned files to
make room), then either *commits* the reservation when its file has landed or *cancels*
it when the write failed::

    used + reserved <= capacity        at every moment, under the index lock

(The disk tier keeps that sum for its whole directory instead, across the indexes of every
fingerprint's tier: :mod:`kvtier.storage.disk.budget` evicts with :meth:`DiskIndex.evict_one`.)

The order is an eviction policy's (:mod:`kvtier.storage.policy`, ``cache_policy``), the same
seam the CPU tier uses: the index tells it what was added, used and removed, and asks it for
victims among the unpinned. Pin counts stay here and never reach the policy: a key's first
pin takes it out of the policy's order (``policy.hold``) and its last unpin puts it back
(``policy.restore``), so an eviction never steps over pinned files. A saved index keeps
the policy's order (next victim first), so a restart resumes it; what else a policy knows
(REUSE's reused/new split) starts afresh.

Not thread-safe by itself: :class:`~kvtier.storage.disk.tier.DiskTier` calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from kvtier.keys import ChunkKey
from kvtier.storage.policy import EvictionPolicy, LruPolicy
from kvtier.storage.policy.base import PolicySeam


@dataclass(frozen=True, slots=True)
class DiskEntry:
    num_tokens: int
    file_bytes: int


class DiskIndex:
    def __init__(self, capacity_bytes: int, policy: EvictionPolicy | None = None) -> None:
        """``policy``: the eviction order (a fresh one for this index; default plain LRU)."""
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.reserved_bytes = 0
        # The order: a policy, or (tenant_quotas) the tier's ledger over one per row.
        self.policy: PolicySeam = policy if policy is not None else LruPolicy()
        self._entries: dict[ChunkKey, DiskEntry] = {}
        self._pins: dict[ChunkKey, int] = {}
        self.pinned_bytes = 0  # the files of the pinned keys: never evicted

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: ChunkKey) -> bool:
        return key in self._entries

    def get(self, key: ChunkKey, *, touch: bool) -> DiskEntry | None:
        entry = self._entries.get(key)
        if entry is not None and touch:
            self.policy.touch([key])
        return entry

    def touch(self, keys: Sequence[ChunkKey]) -> None:
        """``keys`` were used (read here, or hit in a tier above that holds them too); those
        not indexed are skipped (one C-level filter, no Python per key)."""
        held = list(filter(self._entries.__contains__, keys))
        if held:
            self.policy.touch(held)

    def add(self, key: ChunkKey, entry: DiskEntry) -> None:
        """Insert as the newest entry (at open, files are added oldest first)."""
        assert key not in self._entries, "a key is indexed once"
        self._entries[key] = entry
        self.policy.insert(key)
        self.used_bytes += entry.file_bytes

    def add_rows(self, rows: Iterable[tuple[ChunkKey, int, int]]) -> int:
        """Insert ``(key, num_tokens, file_bytes)`` rows in order, each as the newest (a saved
        index, next victim first); a key already indexed is skipped. Entries
        of one size share one :class:`DiskEntry` (immutable), so a million rows cost a dict
        slot each. Returns how many were added."""
        entries, insert = self._entries, self.policy.insert
        shared: dict[tuple[int, int], DiskEntry] = {}
        added = used = 0
        for key, num_tokens, file_bytes in rows:
            if key in entries:
                continue
            entry = shared.get((num_tokens, file_bytes))
            if entry is None:
                entry = shared[num_tokens, file_bytes] = DiskEntry(num_tokens, file_bytes)
            entries[key] = entry
            insert(key)
            used += file_bytes
            added += 1
        self.used_bytes += used
        return added

    def pop(self, key: ChunkKey) -> DiskEntry | None:
        """Forget ``key`` (its pins too: a removed entry has nothing left to protect)."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.used_bytes -= entry.file_bytes
            if self._pins.pop(key, None) is not None:
                self.pinned_bytes -= entry.file_bytes
            self.policy.remove(key)
        return entry

    def drop_all(self) -> int:
        """Forget every entry and pin (their files are gone); reservations of writes still
        running stay, for their commit or cancel. Returns how many entries were dropped."""
        dropped = len(self._entries)
        self._entries.clear()
        self._pins.clear()
        self.policy.clear()
        self.used_bytes = self.pinned_bytes = 0
        return dropped

    # -- pins ------------------------------------------------------------------------------
    def pin(self, key: ChunkKey) -> bool:
        entry = self._entries.get(key)
        if entry is None:
            return False
        count = self._pins.get(key, 0)
        if count == 0:
            self.pinned_bytes += entry.file_bytes
            self.policy.hold(key)
        self._pins[key] = count + 1
        return True

    def unpin(self, key: ChunkKey) -> bool:
        """Drop one pin; False (and nothing changes) when ``key`` holds none."""
        count = self._pins.get(key, 0)
        if count <= 0:
            return False
        if count == 1:
            del self._pins[key]
            self.pinned_bytes -= self._entries[key].file_bytes
            self.policy.restore(key)
        else:
            self._pins[key] = count - 1
        return True

    def is_pinned(self, key: ChunkKey) -> bool:
        return key in self._pins

    @property
    def pinned_keys(self) -> int:
        return len(self._pins)

    # -- capacity --------------------------------------------------------------------------
    @property
    def evictable_bytes(self) -> int:
        """The bytes evicting every unpinned entry would free."""
        return self.used_bytes - self.pinned_bytes

    def reserve(self, nbytes: int) -> list[ChunkKey] | None:
        """Reserve room for a file of ``nbytes``, evicting the policy's unpinned victims.

        Returns the evicted keys (the caller deletes their files), or None, with nothing
        evicted, when even evicting every unpinned entry would not make room. (The disk tier
        reserves through its directory's budget instead, :mod:`~kvtier.storage.disk.budget`,
        which evicts with :meth:`evict_one` across every tier of the directory.)
        """
        free = self.capacity_bytes - self.used_bytes - self.reserved_bytes
        if free + self.evictable_bytes < nbytes:
            return None
        victims: list[ChunkKey] = []
        while free < nbytes:  # usually one victim: files of one layout are one size
            key, file_bytes = self.evict_one()
            victims.append(key)
            free += file_bytes
        self.reserved_bytes += nbytes
        return victims

    def evict_one(self) -> tuple[ChunkKey, int]:
        """Drop the policy's next unpinned victim: its key and file size (the caller deletes
        the file). Only while :attr:`evictable_bytes` > 0."""
        pinned = self._pins.__contains__
        (key,) = self.policy.evict(1, lambda k: not pinned(k))
        file_bytes = self._entries.pop(key).file_bytes
        self.used_bytes -= file_bytes
        return key, file_bytes

    def forget(self, keys: Sequence[ChunkKey]) -> None:
        """Drop ``keys`` (unpinned), which the policy chose and forgot already (a tenant's
        quota victims, :mod:`~kvtier.storage.disk.quotas`); the caller deletes their files."""
        for key in keys:
            self.used_bytes -= self._entries.pop(key).file_bytes

    def commit(self, key: ChunkKey, entry: DiskEntry) -> None:
        self.reserved_bytes -= entry.file_bytes
        self.add(key, entry)

    def cancel(self, nbytes: int) -> None:
        self.reserved_bytes -= nbytes

    def unpinned_keys(self) -> list[ChunkKey]:
        return [k for k in self._entries if k not in self._pins]

    def oldest_first(self) -> list[ChunkKey]:
        """Every key, the next victim first."""
        return list(self.policy.order())

    def items(self) -> Iterator[tuple[ChunkKey, DiskEntry]]:
        """The entries, the next victim first, as an iterator (no list of a million tuples)."""
        entries = self._entries
        return ((key, entries[key]) for key in self.policy.order())

    def key_set(self) -> set[ChunkKey]:
        return set(self._entries)
