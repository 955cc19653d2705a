"""The disk tier's counters: every tier's (:class:`~kvtier.storage.base.TierCounters`) and
its own, changed under the tier's lock."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.storage.base import TierCounters


@dataclass
class DiskCounters(TierCounters):
    """The disk tier's own counts, beside every tier's (changed under the tier's lock)."""

    dropped_inflight: int = 0  # refused by the write queue: a slow disk throttles stores
    dropped_too_large: int = 0  # one record larger than the whole capacity
    dropped_no_room: int = 0  # every file is pinned: nothing to evict
    no_space: int = 0  # ENOSPC / EDQUOT / EFBIG while writing
    read_errors: int = 0  # an OSError while reading (counted as a miss)
    batched_reads: int = 0  # chunks read through get_many_into (overlapped on the reader pool)
    temp_removed: int = 0  # leftovers of interrupted writes, deleted at open
    bad_removed_at_open: int = 0  # files with a bad header or length, deleted at open
    pinned_keys: int = 0  # gauge: keys pinned now
    inflight_bytes: int = 0  # gauge: bytes queued or being written (as of the last usage())
    read_timeouts: int = 0  # reads past blocking_timeout_secs (a stuck filesystem): misses
    stalled_reads: int = 0  # gauge: such reads still running
    directory_lost: int = 0  # the directory was deleted (or became unusable) while open
    directory_reopened: int = 0  # ... and was re-opened once usable again
    available: int = 1  # gauge: 0 while the directory is lost
