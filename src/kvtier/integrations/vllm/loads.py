"""Loads on the worker: kvtier pages -> a request's vLLM blocks, in the step or in the
background.

    sync   (every chunk in the CPU tier)   in start_load_kv, before the forward
    async  (some chunk on disk or Redis)   on a loader thread while vLLM keeps stepping other
                                           requests; vLLM holds the request in
                                           WAITING_FOR_REMOTE_KVS until :meth:`finished`
                                           names it

Where the kernel reaches kvtier's pages (:mod:`.one_copy`), a load scatters straight from
the pages into vLLM's blocks: no staging, no device window (``one_copy``). Otherwise, on a
device, it goes through pinned host staging and a window of ``WINDOW_CHUNKS`` chunks.

A load that comes up short (a chunk failed its checksum or vanished) reports the blocks from
the first one it could not fill (:meth:`failed_blocks`: vLLM recomputes them) and the tokens
it did deliver (:meth:`short_loads`: the scheduler re-saves the recomputed chunks). For an
async load both are recorded before the request is reported finished, as vLLM requires.

Leases and loads: each load runs inside ``cache.loading(rid)``, the cache's own busy count
on the request's lease. A load runs only for a request whose lookup lease is open, and an
``end`` that arrives while one of its loads is running releases the lease when the load is
done: the pins it reads must stay until its last byte is copied. A load for a request that
already ended is skipped (a retrieve would open a fresh lease nobody ends).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from kvtier.cache import KVCache
from kvtier.cpu_affinity import unpin_current_thread
from kvtier.errors import KVTierError, StateError
from kvtier.integrations.vllm.copy_buffer import CopyBuffer
from kvtier.integrations.vllm.metadata import LoadSpec
from kvtier.integrations.vllm.one_copy import OneCopy
from kvtier.integrations.vllm.paged import NULL_BLOCK, PagedKV
from kvtier.integrations.vllm.states import PagedState
from kvtier.memory.device import LANDED, CopyEngine, DeviceCopies, Direction, Landed

log = logging.getLogger(__name__)

Scratch = Callable[[int], torch.Tensor]
WINDOW_CHUNKS = 4  # device memory a load on a GPU holds: this many chunks of every layer


class Loads:
    def __init__(
        self,
        cache: KVCache,
        paged: PagedKV,
        block_size: int,
        states: PagedState | None = None,
        attention_tables: Callable[[Any], Any] = lambda tables: tables,
        copies: CopyEngine | None = None,
        one_copy: OneCopy | None = None,
    ) -> None:
        """``states``: the model's state layers (the state at the load's end is restored
        with it); ``attention_tables``: a spec's tables without the state groups';
        ``copies``: who copies host memory to the device (a test's may land late);
        ``one_copy``: the kernel's path straight from the pages (:meth:`run` without a
        buffer)."""
        self.cache = cache
        self.paged = paged
        self.block_size = block_size
        self.states = states
        self.one_copy = one_copy
        self._attention_tables = attention_tables
        self._lock = threading.Lock()  # guards the three result fields
        self._failed: set[int] = set()
        # Several KV-cache groups: block ids are unique only within a group, so vLLM takes
        # failures per request (failed_recving, async loads only), never per block.
        self.per_request = paged.num_groups > 1 or states is not None
        self._failed_requests: set[str] = set()
        self._short: dict[str, int] = {}
        self._done: set[str] = set()
        # KV on a device is loaded through host staging and a window of WINDOW_CHUNKS
        # chunks of device memory (run's ``window``), never a prompt-sized device scratch.
        self.copies = copies if copies is not None else DeviceCopies()
        # Per staging buffer (one per thread), its last window's copy: it still reads it.
        self._pending: dict[int, Landed] = {}
        # The loader thread's own buffers: the model thread's may be in use.
        chunk, device = cache.config.chunk_size, paged.layers[0].device
        self._host = CopyBuffer(cache.layout, chunk, torch.device("cpu"), pin=device.type == "cuda")
        self._window = CopyBuffer(cache.layout, chunk, device)
        # One loader thread, started by the first submit: loads queue behind each other.
        self._pool = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="kvtier-load", initializer=unpin_current_thread
        )

    @property
    def staged(self) -> bool:
        """Whether loads go through host staging and a device window (the KV is device
        memory, and the model keeps no states: those are restored from the whole load)."""
        return (
            self.one_copy is None
            and self.states is None
            and self.copies.on_device(self.paged.layers[0])
        )

    @property
    def window_tokens(self) -> int:
        """Rows of a load's device window."""
        return WINDOW_CHUNKS * self.cache.config.chunk_size

    @property
    def scratch_tokens(self) -> int:
        """Device rows (every layer) the loader thread holds: its window, or its scratch."""
        return self._window.tokens

    def run(
        self, spec: LoadSpec, out: torch.Tensor | None = None, window: torch.Tensor | None = None
    ) -> None:
        """Load ``spec`` now (``out``: a ``[2, layers, >=len(tokens) - base, hidden]``
        scratch whose row 0 is token ``base``, the chunk start of ``spec.start``: vLLM's own
        prefix is neither loaded nor given room, see :func:`scratch_tokens`). With
        ``window`` (device memory of a few chunks), ``out`` is host staging and the load
        reaches vLLM's blocks one window at a time. Without ``out`` (``one_copy`` only) the
        kernel scatters from the pages themselves."""
        if out is None:
            if self.one_copy is None:
                raise StateError("kvtier worker: a load without a buffer needs the one-copy path")
            tables = self._attention_tables(spec.tables)
            self.record_short(spec, self.one_copy.load(spec, tables))
            return
        chunk = self.cache.config.chunk_size
        base = spec.start // chunk * chunk
        # The last window copy out of this staging has landed before it is written again.
        self._pending.pop(out.untyped_storage().data_ptr(), LANDED).wait()
        loaded = self.fetch(spec, out)
        tables = self._attention_tables(spec.tables)
        if loaded > spec.start and window is not None:
            self._scatter_windows(tables, spec.start, loaded, out, base, window)
        elif loaded > spec.start:
            self.paged.scatter(tables, spec.start, loaded, out, base)
            if self.states is not None:
                self.states.scatter(spec.group_block_ids, loaded, chunk, out, base)
        self.record_short(spec, loaded)

    def fetch(self, spec: LoadSpec, out: torch.Tensor) -> int:
        """Copy ``spec``'s hit into ``out`` (as :meth:`run` takes it; any device) and say how
        much of it vLLM may use: the end of the usable load (``spec.start``: none).
        Scatters nothing and reports nothing."""
        loaded = hit = spec.start
        chunk = self.cache.config.chunk_size
        base = spec.start // chunk * chunk
        with self.cache.loading(spec.request_id) as live:
            if not live:
                log.warning("kvtier: load for ended request %s skipped", spec.request_id)
                return loaded
            try:
                hit = self.cache.retrieve_into(
                    spec.tokens,
                    spec.request_id,
                    out,
                    skip_leading_tokens=spec.start,
                    cache_salt=spec.cache_salt,
                    out_start=base,
                )
            except KVTierError as exc:  # a tier failed outright: recompute all of it
                log.warning("kvtier: load for %s failed: %s", spec.request_id, exc)
                return spec.start
        loaded = max(spec.start, min(hit, spec.end))
        tables = self._attention_tables(spec.tables)
        if loaded > spec.start and not self.paged.restorable(
            tables,
            spec.start,
            loaded,
            chunk,
            hit,  # the last record ends there: a chunk end, or a checkpoint
        ):
            # vLLM holds a real block where a trimmed sliding group kept nothing (never
            # expected): recompute rather than serve zeros.
            log.warning(
                "kvtier: load for %s needs tokens a sliding-window group did not keep; "
                "vLLM recomputes",
                spec.request_id,
            )
            loaded = spec.start
        if self.states is not None and (loaded < spec.end or (loaded % chunk and loaded != hit)):
            # A state is restored only from the record ending where the load ends (a chunk
            # end, or the checkpoint the hit ends at).
            loaded = spec.start
        return loaded

    def record_short(self, spec: LoadSpec, loaded: int) -> None:
        """Report ``spec``'s load as ending at ``loaded`` (nothing when it is whole): vLLM
        recomputes from the block holding the first token that did not arrive. A later call
        for the same request (a layer-wise load that failed after a short fetch) replaces
        the delivered count and adds blocks."""
        if loaded >= spec.end:
            return
        # vLLM recomputes from the first failed block on: report every block from the one
        # holding the first token that did not arrive.
        first, last = loaded // self.block_size, -(-spec.end // self.block_size)
        with self._lock:
            self._short[spec.request_id] = loaded
            if self.per_request:
                self._failed_requests.add(spec.request_id)
            else:
                self._failed.update(_blocks(spec, first, last))
        log.warning(
            "kvtier: request %s loaded %d of %d tokens; vLLM recomputes the rest",
            spec.request_id,
            loaded - spec.start,
            spec.end - spec.start,
        )

    def _scatter_windows(
        self,
        tables: Any,
        start: int,
        end: int,
        staging: torch.Tensor,
        base: int,
        window: torch.Tensor,
    ) -> None:
        """Tokens ``start..end-1`` of ``staging`` (row 0: token ``base``) into vLLM's blocks
        through ``window``, as many rows at a time as it holds. Each window's copy is one
        batch; its scatter runs after it landed: on CUDA the batch orders the model's stream
        (and the next copy waits for that scatter), elsewhere the host waits for it."""
        rows = int(window.shape[2])
        ordered = window.device.type == "cuda"
        a = start
        while a < end:
            b = min(end, a + rows)
            batch = self.copies.begin(window, Direction.LOAD)
            batch.copy(window[:, :, : b - a], staging[:, :, a - base : b - base])
            landed = batch.close()
            if not ordered:
                landed.wait()
            self.paged.scatter(tables, a, b, window, a)
            self._pending[staging.untyped_storage().data_ptr()] = landed
            a = b

    def submit(self, spec: LoadSpec) -> None:
        """Load ``spec`` on the loader thread; :meth:`finished` names it when done."""
        self._pool.submit(self._run_async, spec)

    def _run_async(self, spec: LoadSpec) -> None:
        try:
            rows = scratch_tokens(spec, self.cache.config.chunk_size)
            if self.one_copy is not None:
                self.run(spec)
                self.one_copy.fence().wait()  # landed before vLLM is told it is finished
            elif self.staged:
                self.run(spec, self._host.rows(rows), self._window.rows(self.window_tokens))
            else:
                self.run(spec, self._window.rows(rows))
        except Exception:  # never leave vLLM waiting: report every block as failed
            log.exception("kvtier: async load for %s crashed", spec.request_id)
            with self._lock:
                self._short[spec.request_id] = spec.start
                if self.per_request:
                    self._failed_requests.add(spec.request_id)
                else:
                    self._failed.update(_blocks(spec, spec.start // self.block_size, None))
        finally:
            with self._lock:
                self._done.add(spec.request_id)

    # -- what the step reports -------------------------------------------------------------
    # vLLM asks these every step, and on almost every step there is nothing: an empty
    # container is answered without the lock (a load that lands meanwhile is reported at
    # the next step, exactly as if it had landed just after the call).
    def finished(self) -> set[str]:
        if not self._done:
            return set()
        with self._lock:
            done, self._done = self._done, set()
        return done

    def failed_blocks(self) -> set[int]:
        if not self._failed:
            return set()
        with self._lock:
            failed, self._failed = self._failed, set()
        return failed

    def failed_requests(self, done: set[str]) -> set[str]:
        """Of the finished async loads ``done``, those that failed (several KV-cache groups):
        vLLM recomputes each from its start. A failure whose load is not reported done yet
        stays for a later step."""
        with self._lock:
            failed = self._failed_requests & done
            self._failed_requests -= failed
        return failed

    def short_loads(self) -> dict[str, int]:
        if not self._short:
            return {}
        with self._lock:
            short, self._short = self._short, {}
        return short

    def is_short(self, rid: str) -> bool:
        if not self._short:
            return False
        with self._lock:
            return rid in self._short

    def close(self) -> None:
        """Wait for running loads (they hold pins), then stop the loader thread."""
        self._pool.shutdown(wait=True)


def scratch_tokens(spec: LoadSpec, chunk: int) -> int:
    """Rows a load's scratch needs: from the chunk start of ``spec.start`` (what vLLM holds
    already is not loaded) to the prompt's end (a hit may end past the tokens vLLM accepted,
    by less than a block, and the load lands whole records)."""
    return len(spec.tokens) - spec.start // chunk * chunk


def _blocks(spec: LoadSpec, first: int, last: int | None) -> set[int]:
    """Block ids ``first..last-1`` of every group's table (never vLLM's null block)."""
    tables = spec.group_block_ids or (spec.block_ids,)
    return {b for table in tables for b in table[first:last] if b != NULL_BLOCK}
