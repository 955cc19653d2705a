"""One ``max_local_disk_size`` per directory: the budget every disk tier open on it shares.

A directory holds the files of several fingerprints (``<fp16hex>-<key>.kvc``): ``kvtier
server`` opens one disk tier per model on it, and every redeploy (a new model path, chunk
size or TP layout) is a new fingerprint. The size is the operator's promise about the
directory, so it bounds all of them together::

    used + reserved of every open tier  +  released files  <=  capacity
    (each tier's DiskIndex)                (other fingerprints' files no open tier owns)

*Released files* are those of fingerprints no tier of this process has open: a model the
server released, files left by an earlier run, or files of another process's tier (two
vLLM instances on one path; see below). The tier's own listing finds them (the header scan
at open, or the background check of a saved index: :mod:`~kvtier.storage.disk.reconcile`),
by name and size only; a tier that closes hands its files over too. When a reservation does
not fit, victims are taken in this order until it does::

    1. released files, oldest first (mtime; a tier closed here counts as released then)
    2. the open tiers' own policy victims (DiskIndex.evict_one), each from the tier holding
       the most bytes at that moment;  pinned files never

and if even that cannot make room nothing is evicted (the write is dropped). At open, and
when the check of a saved index ends, the same order trims a directory already over budget.

One object per directory (by device and inode) per process, and one lock: every tier of the
directory uses :attr:`DirectoryBudget.lock` as its own lock, so one tier's write can evict
another's files with no lock order to get wrong. Tiers configured with different sizes get
the smallest (logged once per change).

Across processes only what a listing sees is counted: a tier counts another process's files
at its open (and evicts them first when short of room), not the files that process writes
later, so two processes on one directory can hold up to two budgets between their opens.
Saved indexes (``.<fp16hex>.index``, 28 bytes per chunk) are not counted.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from kvtier.config.sizes import format_size
from kvtier.keys import ChunkKey
from kvtier.storage.disk import files, snapshot
from kvtier.storage.disk.index import DiskIndex

log = logging.getLogger(__name__)


class BudgetMember(Protocol):
    """A disk tier as its directory's budget sees it
    (:class:`~kvtier.storage.disk.tier.DiskTier`). Called under :attr:`DirectoryBudget.lock`
    except :meth:`report_evicted`."""

    fp_hex: str

    @property
    def index(self) -> DiskIndex: ...

    @property
    def configured_bytes(self) -> int: ...  # its max_local_disk_size

    def directory(self) -> tuple[int, int]: ...  # (generation, fd)

    def drop_evicted(self, keys: Sequence[ChunkKey]) -> None: ...  # unlink, count

    def report_evicted(self, keys: Sequence[ChunkKey]) -> None: ...  # to its listeners


class Evicted:
    """What one reservation or trim evicted: keys by tier, and released files. The tier
    calls :meth:`report` once it has let go of the lock."""

    def __init__(self) -> None:
        self.keys: dict[BudgetMember, list[ChunkKey]] = {}
        self.released_files = 0

    def of(self, member: BudgetMember) -> list[ChunkKey]:
        return self.keys.get(member, [])

    def __len__(self) -> int:
        return self.released_files + sum(map(len, self.keys.values()))

    def report(self) -> None:
        for member, keys in self.keys.items():
            member.report_evicted(keys)


class DirectoryBudget:
    """See the module docstring. Every method but the constructor runs under :attr:`lock`."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.lock = threading.Lock()
        self.capacity_bytes = 0
        self._members: list[BudgetMember] = []
        self._released: deque[files.OtherFile] = deque()  # the next victim first
        self._released_bytes = 0
        self._released_per_fp: dict[str, int] = {}  # how many files each released fp has

    # -- membership --------------------------------------------------------------------------
    def join(self, member: BudgetMember) -> None:
        """``member`` opened on the directory: its files are its own, no longer released."""
        self._members.append(member)
        self._set_capacity()
        self._forget_released(lambda f: f.fp_hex == member.fp_hex)

    def leave(self, member: BudgetMember) -> None:
        """``member`` closed: its files are released (the next victims after those released
        earlier). The last member's leave forgets them all: the next open lists again."""
        self._members.remove(member)
        if not self._members:
            self._set_released([])
            return
        self._set_capacity()
        now, fp_hex = time.time_ns(), member.fp_hex
        self.add_released(
            files.OtherFile(fp_hex, files.final_name(fp_hex, key), entry.file_bytes, now)
            for key, entry in member.index.items()
        )

    def add_released(self, found: Iterable[files.OtherFile]) -> None:
        """Files a listing found (or a closing tier left) of fingerprints not open here."""
        owned = {m.fp_hex for m in self._members}
        by_name = {f.name: f for f in self._released}
        by_name.update((f.name, f) for f in found if f.fp_hex not in owned)
        merged = sorted(by_name.values(), key=lambda f: f.mtime_ns)  # stable: a closed
        self._set_released(merged)  # tier's files keep their order

    def _forget_released(self, which: Callable[[files.OtherFile], bool]) -> None:
        self._set_released([f for f in self._released if not which(f)])

    def _set_released(self, released: list[files.OtherFile]) -> None:
        self._released = deque(released)
        self._released_bytes = sum(f.size for f in released)
        self._released_per_fp = {}
        for f in released:
            self._released_per_fp[f.fp_hex] = self._released_per_fp.get(f.fp_hex, 0) + 1

    def _set_capacity(self) -> None:
        sizes = {m.configured_bytes for m in self._members}
        capacity = min(sizes)
        if len(sizes) > 1 and capacity != self.capacity_bytes:
            log.warning(
                "disk directory %s: its tiers are configured with max_local_disk_size %s; "
                "the smallest, %s, bounds the whole directory",
                self.path,
                " and ".join(format_size(s) for s in sorted(sizes)),
                format_size(capacity),
            )
        self.capacity_bytes = capacity

    # -- room ------------------------------------------------------------------------------
    @property
    def charged_bytes(self) -> int:
        """Everything counted against the capacity now."""
        held = sum(m.index.used_bytes + m.index.reserved_bytes for m in self._members)
        return held + self._released_bytes

    def reserve(self, member: BudgetMember, nbytes: int) -> Evicted | None:
        """Reserve ``nbytes`` in ``member``'s index, evicting in the module's order; None,
        with nothing evicted, when even evicting every unpinned file would not make room."""
        need = self.charged_bytes + nbytes - self.capacity_bytes
        if need > 0:
            can_free = self._released_bytes + sum(m.index.evictable_bytes for m in self._members)
            if can_free < need:
                return None
        evicted = self._evict(need, member)
        member.index.reserved_bytes += nbytes
        return evicted

    def trim(self, member: BudgetMember) -> Evicted:
        """Evict (in the module's order) until the directory fits, or nothing unpinned is
        left; ``member``'s directory descriptor removes released files."""
        return self._evict(self.charged_bytes - self.capacity_bytes, member)

    def _evict(self, need: int, via: BudgetMember) -> Evicted:
        evicted = Evicted()
        freed = 0
        dir_fd = via.directory()[1]
        while freed < need and self._released:
            released = self._released.popleft()
            self._released_bytes -= released.size
            freed += released.size
            evicted.released_files += 1
            files.unlink_quietly(dir_fd, released.name)
            left = self._released_per_fp[released.fp_hex] = (
                self._released_per_fp[released.fp_hex] - 1
            )
            if left == 0:  # its last file: a saved index naming only gone files misleads
                del self._released_per_fp[released.fp_hex]
                files.unlink_quietly(dir_fd, snapshot.snapshot_name(released.fp_hex))
        while freed < need:
            candidates = [m for m in self._members if m.index.evictable_bytes > 0]
            if not candidates:
                break
            largest = max(candidates, key=lambda m: m.index.used_bytes + m.index.reserved_bytes)
            key, file_bytes = largest.index.evict_one()
            evicted.keys.setdefault(largest, []).append(key)
            freed += file_bytes
        for member, keys in evicted.keys.items():
            member.drop_evicted(keys)
        if evicted.released_files:
            log.debug(
                "disk directory %s: %d files of released models evicted to fit %s",
                self.path,
                evicted.released_files,
                format_size(self.capacity_bytes),
            )
        return evicted


_registry_lock = threading.Lock()
_budgets: weakref.WeakValueDictionary[tuple[int, int], DirectoryBudget] = (
    weakref.WeakValueDictionary()
)


def of_directory(dir_fd: int, path: str) -> DirectoryBudget:
    """The budget of the open directory ``dir_fd`` (one per device and inode in this
    process, alive while a tier holds it)."""
    info = os.fstat(dir_fd)
    with _registry_lock:
        budget = _budgets.get((info.st_dev, info.st_ino))
        if budget is None:
            budget = _budgets[info.st_dev, info.st_ino] = DirectoryBudget(path)
        return budget
