"""The disk tier's write path: a put admitted on the caller's thread, its record written on
a writer thread of the write queue (:mod:`kvtier.storage.write_queue`).

Protocol (the tier's :meth:`~kvtier.storage.disk.tier.DiskTier.put` answers ``closed`` with
FAILED at once, then hands the put here)::

    put(key, payload, n, on_done)
      directory lost (and not re-opened now)   -> on_done(DROPPED), counted  at once
      key on disk or being written             -> on_done(EXISTS)            at once
      record larger than the directory budget  -> on_done(DROPPED), counted  at once
      refused by the write queue's admission   -> on_done(DROPPED), counted  at once (never waits)
        (bytes in flight + record > disk_max_inflight_bytes, see storage/write_queue.py)
      else queued on the write queue; a writer thread then:
        reserves room in the directory's budget (evicting released models' files, then
        the open tiers' unpinned policy victims), or on_done(DROPPED) if all are pinned
        writes temp name, fsync, rename, fsync dir  -> on_done(STORED)
        OSError (ENOSPC, EIO, ...)                  -> on_done(FAILED), counted, temp removed

A chunk joins the index (and the membership listeners hear of it) when its write commits,
never when queued. The payload is encoded with the tier's codec (identity by default: the
page itself is written, no copy; :mod:`kvtier.storage.codecs`).
"""

from __future__ import annotations

import errno
import logging

import torch

from kvtier.keys import ChunkKey
from kvtier.repeated_log import RepeatedLog
from kvtier.storage.base import PutJob, PutOutcome, PutResult
from kvtier.storage.disk import files
from kvtier.storage.disk.index import DiskEntry
from kvtier.storage.disk.state import DiskState
from kvtier.storage.records import HEADER_SIZE, encode_parts
from kvtier.storage.write_queue import Write, WriteQueue, complete

log = logging.getLogger(__name__)

_NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


class DiskWrites:
    """One disk tier's puts: admitted at once, written by the queue's threads."""

    def __init__(self, state: DiskState) -> None:
        self._state = state
        options = state.options
        self.queue = WriteQueue(
            options.io_threads, options.max_inflight_bytes, self._write, "kvtier-disk-write"
        )
        # A full disk fails every chunk: one line per 30 s, with a count.
        self._repeated = RepeatedLog(log)

    def put(self, job: PutJob) -> None:
        """Admit the put or answer it at once (the caller holds the tier's call guard:
        close() drains the queue only after this)."""
        state = self._state
        key, payload, num_tokens, on_done = job.key, job.payload, job.num_tokens, job.on_done
        nbytes = HEADER_SIZE + payload.numel()
        refused: PutResult | None = None
        if state.dir.lost:
            state.try_reopen()
        with state.lock:
            if state.dir.lost:
                refused = PutResult(
                    key, PutOutcome.DROPPED, f"disk directory {state.options.path} is gone"
                )
                state.counters.dropped += 1
            elif key in state.index or self.queue.holds(key):
                refused = PutResult(key, PutOutcome.EXISTS)
            elif nbytes > state.capacity_bytes:
                refused = PutResult(
                    key,
                    PutOutcome.DROPPED,
                    f"chunk file of {nbytes} bytes is larger than max_local_disk_size "
                    f"({state.capacity_bytes} bytes for the directory)",
                )
                state.counters.dropped += 1
                state.counters.dropped_too_large += 1
            else:
                why = self.queue.submit(Write(key, payload, num_tokens, nbytes, on_done))
                if why:
                    refused = PutResult(key, PutOutcome.DROPPED, why)
                    state.counters.dropped += 1
                    state.counters.dropped_inflight += 1
                elif state.quotas is not None:  # tenant_quotas: charged when it lands
                    state.quotas.expect(key, job.tenant)
        if refused is not None:
            if refused.outcome is PutOutcome.DROPPED:
                log.debug("disk put of %s dropped: %s", key.hex(), refused.detail)
            complete(on_done, refused)

    def _write(self, write: Write) -> PutResult:
        """Runs on a writer thread (the queue completes ``on_done`` with what it returns)."""
        try:
            return self._write_record(write.key, write.payload, write.num_tokens)
        except Exception:
            log.exception("disk write of %s failed unexpectedly", write.key.hex())
            with self._state.lock:
                self._state.counters.failed += 1
            return PutResult(write.key, PutOutcome.FAILED, "disk writer failed unexpectedly")

    def _write_record(self, key: ChunkKey, payload: torch.Tensor, num_tokens: int) -> PutResult:
        """The file holds the header and the codec's stored bytes, and the index counts what
        the file holds (the write queue counted header + payload in flight)."""
        state = self._state
        header, stored = encode_parts(key, state.fingerprint, num_tokens, payload, state.codec)
        nbytes = HEADER_SIZE + stored.nbytes
        with state.lock:
            if state.dir.lost:
                state.counters.dropped += 1
                return PutResult(key, PutOutcome.DROPPED, "disk directory is gone")
            generation, dir_fd = state.dir.generation, state.dir.fd
            assert state.budget is not None
            evicted = state.budget.reserve(state.owner, nbytes)  # files unlinked, counted
            if evicted is None:
                state.counters.dropped += 1
                state.counters.dropped_no_room += 1
                return PutResult(key, PutOutcome.DROPPED, "disk directory is full of pinned chunks")
        evicted.report()
        try:
            files.write_record(dir_fd, key, state.fp_hex, header, stored)
        except OSError as exc:
            return self._failed(key, nbytes, exc)
        with state.lock:
            if generation != state.dir.generation:  # landed in a directory lost meanwhile
                state.index.cancel(nbytes)
                state.counters.failed += 1
                return PutResult(key, PutOutcome.FAILED, "disk directory was lost meanwhile")
            state.index.commit(key, DiskEntry(num_tokens, nbytes))
            if state.check is not None:
                state.check.written(key)
            state.counters.stored += 1
            state.counters.bytes_written += nbytes
            state.owner.report_added((key,))  # landed: under the lock, before any removal of it
            # tenant_quotas: a tenant over its limit now drops its own oldest files
            over = state.quotas.charge(key) if state.quotas is not None else []
            if over:
                state.unlink(over)
                state.counters.evicted += len(over)
        if over:
            state.owner.report_evicted(over)
        return PutResult(key, PutOutcome.STORED)

    def _failed(self, key: ChunkKey, nbytes: int, exc: OSError) -> PutResult:
        """The record's file could not be written (its temporary file is removed): give back
        the room reserved for it and count why."""
        state = self._state
        with state.lock:
            state.index.cancel(nbytes)
            state.counters.failed += 1
            if exc.errno in _NO_SPACE:
                state.counters.no_space += 1
        if exc.errno == errno.ENOENT:
            state.check_directory()  # the directory itself gone? (logged there)
        if not state.dir.lost:
            self._repeated.warning(
                ("write", exc.errno),
                "disk write of chunk %s failed (%s); it is not stored",
                key.hex(),
                exc,
            )
        return PutResult(key, PutOutcome.FAILED, f"disk write failed: {exc}")
