"""The prefiller's send buffer: a request's chunks, held until the decoder the router picked
comes to pull them (xPyD: the prefiller does not know that decoder when it prefills).

Who owns what (every page reference has exactly one owner, given back once)::

    reference owner              taken by                     given back by
    a Transfer (one request)     hold(): one ref per chunk,   Transfer end, once: served
                                 copied in OR already held    (single use), failed while
                                 by another transfer          served, expired (TTL), close

The index (key -> page) owns no reference: a chunk lives exactly as long as some transfer
holds it, so once every transfer has ended the whole buffer is free. A key already present
is shared (one reference for this transfer, nothing more: LMCache #2847's leak cannot
happen); a chunk a transfer already holds is not held twice.

Rules:

* ``pd_buffer_size`` rounded down to whole chunks (a ceiling; below one chunk is an error);
* holding never waits: with no free page the transfer stops at the chunks it has (the
  decoder prefills the rest; chunk ``i`` is only of use after ``0..i-1``), since the
  prefiller's forward step must not block on a decoder that has not come yet;
* a transfer not claimed ``ttl`` seconds after its last chunk arrived is freed (``expire``);
* a claim names the transfer id **and** the decoder's chunk keys for its prompt (which
  carry its ``cache_salt`` and extra keys): the transfer's keys must be a prefix of them,
  else the claim is refused and the transfer stays for the right decoder; a claimed transfer
  can be claimed by no one else (single use), and ends when its serving does.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvtier.errors import StateError, TransferError
from kvtier.keys import ChunkKey
from kvtier.memory.block_pool import BlockPool

Write = Callable[[int, torch.Tensor], None]  # (position in the hold, page bytes) -> fills it


class ClaimRefused(TransferError):
    """A decoder's claim that the buffer does not serve; ``kind`` goes on the wire."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class State(enum.Enum):
    OPEN = "open"  # taking chunks, waiting for its decoder
    CLAIMED = "claimed"  # a decoder is pulling it: no one else may
    ENDED = "ended"  # its pages are given back


@dataclass(eq=False)
class Transfer:
    """One request's held chunks, in prompt order (a Hold-like owner: ended once)."""

    transfer_id: str
    deadline: float
    keys: list[ChunkKey] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)  # one reference each, owned here
    num_tokens: list[int] = field(default_factory=list)
    state: State = State.OPEN
    truncated: bool = False  # a chunk found no room: nothing after it is held


@dataclass
class SendCounters:
    held_chunks: int = 0  # chunks copied into the buffer
    shared_chunks: int = 0  # chunks another transfer held already (a reference, no copy)
    truncated: int = 0  # transfers cut short by a full buffer
    served: int = 0  # transfers claimed by their decoder
    refused_claims: int = 0  # claims of an unknown, used or mismatched transfer
    expired: int = 0  # transfers nobody claimed within the TTL


class SendBuffer:
    def __init__(
        self,
        num_pages: int,
        page_bytes: int,
        *,
        ttl: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.num_pages = num_pages
        self.page_bytes = page_bytes
        self.ttl = ttl
        self._clock = clock
        self._pool: BlockPool | None = None
        self._index: dict[ChunkKey, int] = {}  # key -> page (no reference of its own)
        self._page_key: dict[int, ChunkKey] = {}
        self._transfers: dict[str, Transfer] = {}
        self._lock = threading.RLock()
        self.counters = SendCounters()

    # -- lifecycle -------------------------------------------------------------------------
    def open(self) -> SendBuffer:
        with self._lock:
            if self._pool is None:
                self._pool = BlockPool(self.num_pages, self.page_bytes)
        return self

    def close(self) -> None:
        with self._lock:
            for transfer in list(self._transfers.values()):
                self._end_locked(transfer)
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    @property
    def pool(self) -> BlockPool:
        if self._pool is None:
            raise StateError("the PD send buffer is not open")
        return self._pool

    # -- the prefiller's side --------------------------------------------------------------
    def hold(
        self, transfer_id: str, keys: Sequence[ChunkKey], num_tokens: Sequence[int], write: Write
    ) -> int:
        """Hold chunks ``keys`` (in prompt order, after those already held) for
        ``transfer_id``; ``write(i, page_view)`` copies chunk ``i`` into its page. Returns how
        many chunks this call added. A claimed or ended transfer takes nothing more."""
        with self._lock:
            pool = self.pool
            transfer = self._transfers.get(transfer_id)
            if transfer is None:
                transfer = Transfer(transfer_id, self._clock() + self.ttl)
                self._transfers[transfer_id] = transfer
            if transfer.state is not State.OPEN or transfer.truncated:
                return 0
            added = 0
            for i, (key, tokens) in enumerate(zip(keys, num_tokens, strict=True)):
                if key in transfer.keys:
                    continue  # saved twice (a request preempted and resumed): held once
                page = self._index.get(key)
                if page is not None:
                    pool.retain([page])
                    self.counters.shared_chunks += 1
                else:
                    fresh = pool.allocate(1)
                    if fresh is None:
                        transfer.truncated = True
                        self.counters.truncated += 1
                        break
                    page = fresh[0]
                    # Written under the lock: nobody may find the key before its bytes are in.
                    write(i, pool.page_bytes_view(page))
                    self._index[key] = page
                    self._page_key[page] = key
                    self.counters.held_chunks += 1
                transfer.keys.append(key)
                transfer.pages.append(page)
                transfer.num_tokens.append(tokens)
                added += 1
            transfer.deadline = self._clock() + self.ttl
            return added

    # -- the decoder's side ----------------------------------------------------------------
    def claim(self, transfer_id: str, keys: Sequence[ChunkKey]) -> Transfer:
        """Take ``transfer_id`` for the decoder whose prompt has chunk ``keys``; raises
        :class:`ClaimRefused` (kind ``unknown``, ``claimed`` or ``mismatch``)."""
        with self._lock:
            transfer = self._transfers.get(transfer_id)
            refused: ClaimRefused | None = None
            if transfer is None or transfer.state is State.ENDED:
                refused = ClaimRefused(
                    "unknown", f"no transfer {transfer_id!r} here (served, expired or never held)"
                )
            elif transfer.state is State.CLAIMED:
                refused = ClaimRefused("claimed", f"transfer {transfer_id!r} is already claimed")
            elif list(keys[: len(transfer.keys)]) != transfer.keys:
                refused = ClaimRefused(
                    "mismatch",
                    f"transfer {transfer_id!r} holds other chunks than this prompt's (another "
                    "prompt, cache_salt or extra keys)",
                )
            if refused is not None:
                self.counters.refused_claims += 1
                raise refused
            assert transfer is not None
            transfer.state = State.CLAIMED
            self.counters.served += 1
            return transfer

    def chunk_view(self, transfer: Transfer, i: int, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of chunk ``i``'s page (valid while ``transfer`` holds it)."""
        if transfer.state is State.ENDED:
            raise StateError(f"transfer {transfer.transfer_id!r} has ended")
        return self.pool.page_bytes_view(transfer.pages[i], nbytes)

    def end(self, transfer: Transfer) -> bool:
        """Give ``transfer``'s pages back; False (and nothing given) when it had ended."""
        with self._lock:
            return self._end_locked(transfer)

    def expire(self) -> list[str]:
        """End every unclaimed transfer past its TTL; returns their ids."""
        with self._lock:
            now = self._clock()
            late = [
                t for t in self._transfers.values() if t.state is State.OPEN and now > t.deadline
            ]
            for transfer in late:
                self._end_locked(transfer)
            self.counters.expired += len(late)
            return [t.transfer_id for t in late]

    def _end_locked(self, transfer: Transfer) -> bool:
        if transfer.state is State.ENDED:
            return False
        transfer.state = State.ENDED
        if self._transfers.get(transfer.transfer_id) is transfer:
            del self._transfers[transfer.transfer_id]
        if self._pool is None:
            return True  # closed: the whole pool is gone
        self._pool.release(transfer.pages)
        for page in transfer.pages:
            if self._pool.refcount(page) == 0:
                key = self._page_key.pop(page, None)
                if key is not None and self._index.get(key) == page:
                    del self._index[key]
        return True

    # -- inspection ------------------------------------------------------------------------
    def transfer(self, transfer_id: str) -> Transfer | None:
        with self._lock:
            return self._transfers.get(transfer_id)

    def stats(self) -> dict[str, int]:
        with self._lock:
            used = self._pool.used_pages if self._pool is not None else 0
            return {
                "transfers": len(self._transfers),
                "used_bytes": used * self.page_bytes,
                "capacity_bytes": self.num_pages * self.page_bytes,
                **vars(self.counters),
            }

    def check_invariants(self) -> list[str]:
        """Problems as sentences (empty when fine): each page's refcount equals the live
        transfers holding it, the free list matches, and the index names held pages only."""
        with self._lock:
            refs, free = self.pool.snapshot()
            owners = [0] * self.num_pages
            for transfer in self._transfers.values():
                for page in transfer.pages:
                    owners[page] += 1
            problems = [
                f"page {page}: refcount {ref}, owners {owners[page]}"
                for page, ref in enumerate(refs)
                if ref != owners[page]
            ]
            if free != refs.count(0):
                problems.append(f"{free} free pages listed, {refs.count(0)} with refcount 0")
            for key, page in self._index.items():
                if refs[page] == 0:
                    problems.append(f"index entry {key.hex()} on free page {page}")
            return problems
