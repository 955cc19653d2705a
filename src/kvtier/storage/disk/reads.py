"""The disk tier's read path: a chunk's file read into the caller's page and checked.

An identity file is read straight into the caller's page (``preadv``, in 1 MiB pieces each
hashed right after it lands, so the checksum costs no second pass over memory); another
codec's stored bytes land in a scratch buffer, hashed the same way, and are decoded into the
page once their checksum matches. A mismatch, a bad header or a wrong length is a miss:
logged, file removed, counted in ``counters.corrupt``; a file of another format version or
of an unknown codec too, logged once per 30 s (:mod:`kvtier.storage.records`). A file gone
from under its index entry is a miss (and the directory is checked: it may be gone too).

Reads run on the reader pool, bounded by ``blocking_timeout_secs``
(:mod:`~kvtier.storage.disk.bounded_reads`); a stuck one is a miss for its caller.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from kvtier.errors import CorruptRecord, UnknownRecordFormat
from kvtier.keys import ChunkKey
from kvtier.repeated_log import RepeatedLog
from kvtier.storage.disk import files
from kvtier.storage.disk.bounded_reads import BoundedReads
from kvtier.storage.disk.state import DiskState
from kvtier.storage.record_reads import finish_read, payload_hasher

log = logging.getLogger(__name__)


class DiskReads:
    """One disk tier's reads, each checked against its record's checksum."""

    def __init__(self, state: DiskState) -> None:
        self._state = state
        # Files of another format come in crowds: one line per 30 s, with a count.
        self._repeated = RepeatedLog(log)

    def read(
        self, pool: BoundedReads, items: Sequence[tuple[ChunkKey, torch.Tensor]]
    ) -> list[int | None]:
        """The reads, bounded by the timeout (see kvtier.storage.disk.bounded_reads)."""
        state = self._state
        results = None if state.dir.lost else pool.read(self._read_one, items)
        if results is None:  # the directory is gone, or a stuck read stalls the tier
            with state.lock:
                state.counters.misses += len(items)
            return [None] * len(items)
        return results

    def _read_one(self, key: ChunkKey, out: torch.Tensor) -> int | None:
        """One read, on a reader thread (the caller waits on it, bounded)."""
        state = self._state
        with state.lock:
            # A pinned key was touched when its lookup pinned it: touching it again per read
            # would reorder a run parent-first (the policy wants one touch per use).
            entry = state.index.get(key, touch=not state.index.is_pinned(key))
            dir_fd = state.dir.fd
            if entry is None:
                state.counters.misses += 1
                return None
        payload_len = state.fingerprint.layout.payload_bytes(entry.num_tokens)
        if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < payload_len:
            raise ValueError(f"out must be a flat uint8 tensor of >= {payload_len} bytes")
        target = out[:payload_len]
        hasher = payload_hasher()  # fed piece by piece as the stored bytes land: one pass
        try:
            found = files.read_record_into(
                dir_fd, key, state.fingerprint, state.fp_hex, target, hasher.update
            )
            header = None
            if found is not None:
                header, stored = found
                finish_read(header, hasher.digest(), stored, target, state.fingerprint.layout)
        except UnknownRecordFormat as exc:
            # Comes in crowds (every file of the kvtier before an upgrade): one line per 30 s.
            self._repeated.warning(
                "format",
                "disk chunk %s is in a format this kvtier does not read (%s): removed, "
                "counted as a corrupt miss",
                key.hex(),
                exc,
            )
            self._corrupt(key, str(exc))
            return None
        except CorruptRecord as exc:
            log.warning("disk chunk %s is corrupt (%s): removed, counted as a miss", key.hex(), exc)
            self._corrupt(key, str(exc))
            return None
        except OSError as exc:
            log.warning("disk read of chunk %s failed (%s): counted as a miss", key.hex(), exc)
            with state.lock:
                state.counters.misses += 1
                state.counters.read_errors += 1
            return None
        if header is None:  # the file vanished under us (removed by hand, or evicted)
            self._forget(key, corrupt=False)
            state.check_directory()  # ... or with its whole directory
            return None
        with state.lock:
            state.counters.hits += 1
            state.counters.bytes_read += header.payload_len
        files.touch(dir_fd, state.fp_hex, key)  # the next open restores this recency
        return header.num_tokens

    def _corrupt(self, key: ChunkKey, reason: str) -> None:
        self._state.owner.note_corrupt(key, reason)
        self._forget(key, corrupt=True)

    def _forget(self, key: ChunkKey, *, corrupt: bool) -> None:
        state = self._state
        with state.lock:
            if state.index.pop(key) is not None:
                state.owner.report_removed((key,))
            state.counters.misses += 1
            if corrupt:
                state.counters.corrupt += 1
            state.counters.pinned_keys = state.index.pinned_keys
            if corrupt:
                state.unlink([key])
