"""The PD receive tier: the decoder's bounded receive buffer, first among its lower tiers.

Who owns what (every page reference has exactly one owner, and each owner gives it back once)::

    reference owner                  taken by                 given back by
    a Reservation (one request)      reserve(): one ref per   Reservation.release(), once,
                                     page it needs, received  from the request's lease
                                     OR already held          (end_request) or early on
                                                              abort / sender death / timeout
    a key pin (Tier.pin)             pin()                    unpin()

The index (key -> entry, :mod:`kvtier.pd.received_index`) owns no reference: a received chunk
lives exactly as long as some request holds it, and its entry goes with its page's last
reference. So after every request ends, the whole buffer is free (LMCache's PD buffer is
likewise never an LRU cache; its pages go back after decode).

The rules: a key the decoder already holds is answered "held" and the request's reservation
takes one reference on it, given back with the reservation; nothing else takes one, so no
reference can outlive the request. Every pin is owned by a lease or a reservation whose
release is idempotent, so a pin is released once on every path, never twice. The buffer is
``pd_buffer_size`` rounded down to whole chunks (a ceiling; below one chunk is an error).

Reservation is all or nothing (``BlockPool.allocate``), so two requests can never each hold
half of what they need. When the buffer is short, ``reserve`` waits (woken by every release)
up to its timeout, then raises :class:`TransferTimeout`. With ``tenant_quotas``, a tenant's
reservations also stay within its share (:mod:`kvtier.pd.tenant_shares`), waiting the same way.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.config import Config
from kvtier.config.effects import HOST_RECEIVE_BUFFER
from kvtier.config.sizes import format_size
from kvtier.errors import ConfigError, StateError, TransferError, TransferTimeout
from kvtier.fingerprint import Fingerprint
from kvtier.keys import ChunkKey
from kvtier.layout import KVLayout
from kvtier.lease import LeaseTable
from kvtier.memory.block_pool import BlockPool, pages_for_capacity
from kvtier.pd.buffer_audit import page_problems
from kvtier.pd.channels import receiver_channel
from kvtier.pd.channels.base import ReceiverChannel
from kvtier.pd.checksum import checksum
from kvtier.pd.received_index import ReceivedIndex
from kvtier.pd.reservation import Reservation, live_reservations
from kvtier.pd.serve_copy import ServeCopier
from kvtier.pd.tenant_shares import TenantShares
from kvtier.storage.base import PutJob, PutOutcome, Tier, TierCounters, TierUsage
from kvtier.storage.key_pins import KeyPins
from kvtier.storage.tenants.quotas import TenantQuotas

log = logging.getLogger(__name__)


class TooLarge(TransferError):
    """A request needs more pages than the whole receive buffer has."""


@dataclass
class PDCounters(TierCounters):
    """The PD buffer's own counts, beside every tier's."""

    transfers: int = 0  # requests whose transfer completed (kvtier_pd_transfers)
    transfer_failures: int = 0  # ... and whose transfer failed
    auth_failures: int = 0  # peers that failed the handshake
    timeouts: int = 0  # connections closed at a deadline (a silent or half-sent peer)
    protocol_errors: int = 0  # malformed, oversized or out-of-order frames
    expired_reservations: int = 0  # reservations freed by pd_reservation_ttl_sec


class PDBuffer(Tier):
    name = "pd"
    medium = None  # not published: what it holds is on its way into vLLM, not cached
    serves_views = True
    counters: PDCounters

    def __init__(
        self,
        num_pages: int,
        page_bytes: int,
        token_bytes: int,
        channel: ReceiverChannel,
        payload_bytes: Callable[[int], int] | None = None,
    ) -> None:
        """``payload_bytes``: a chunk's bytes by its token count (``KVLayout.payload_bytes``;
        default ``tokens * token_bytes``: no KV-cache group trimmed)."""
        super().__init__()
        self.counters = PDCounters()
        self.num_pages = num_pages
        self.page_bytes = page_bytes
        self.token_bytes = token_bytes
        self.payload_bytes: Callable[[int], int] = payload_bytes or (lambda n: n * token_bytes)
        self.max_tokens = _tokens_per_page(self.payload_bytes, page_bytes)
        self.channel = channel
        self._pool: BlockPool | None = None
        self._index = ReceivedIndex()
        self._key_pins = KeyPins()
        self._cond = threading.Condition(threading.RLock())
        self._serving = ServeCopier()
        self.shares = TenantShares(num_pages, page_bytes)

    @classmethod
    def from_config(cls, config: Config, layout: KVLayout, fingerprint: Fingerprint) -> PDBuffer:
        if config.pd_buffer_size is None:
            raise ConfigError("pd_buffer_size", None, "a size in bytes for a PD receiver")
        page_bytes = layout.chunk_bytes(config.chunk_size)
        pages = pages_for_capacity("pd_buffer_size", config.pd_buffer_size, page_bytes)
        if config.pd_buffer_device == "cuda":
            # LMCache's PD configs all say cuda; kvtier has only a host buffer (the load
            # copies from it), so the value is accepted and its cost said once, here.
            log.warning(
                "pd_buffer_device 'cuda' %s: %d pages, %s",
                HOST_RECEIVE_BUFFER,
                pages,
                format_size(pages * page_bytes),
            )
        return cls(
            pages,
            page_bytes,
            layout.token_bytes(),
            receiver_channel(config.transfer_channel),
            layout.payload_bytes,
        )

    # -- lifecycle -------------------------------------------------------------------------
    def open(self) -> None:
        with self._cond:
            if self._pool is None:
                self._pool = self.channel.make_pool(self.num_pages, self.page_bytes)
                self._serving.open()

    def close(self) -> None:
        self.shares.detach()
        with self._cond:
            pool, self._pool = self._pool, None
            self._index.clear()
            self._key_pins.clear()
            self.shares.clear()
            self._cond.notify_all()
        if pool is not None:
            pool.close()
        self._serving.close()
        self.channel.close()

    @property
    def pool(self) -> BlockPool:
        if self._pool is None:
            raise StateError("the PD tier is not open")
        return self._pool

    def attach_quotas(self, quotas: TenantQuotas) -> None:
        """Keep each tenant's reservations within its share (:mod:`kvtier.pd.tenant_shares`);
        a changed limit wakes the reservations waiting for room."""
        self.shares.attach(quotas, self._wake, self._cond)
        self.tenants = self.shares

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # -- the receive side ------------------------------------------------------------------
    def reserve(
        self,
        request_id: str,
        keys: Sequence[ChunkKey],
        num_tokens: Sequence[int],
        timeout: float,
        tenant: str = "",
    ) -> tuple[Reservation, list[int]]:
        """Reserve the whole request at once: ``(reservation, held positions)``.

        Keys already in the buffer are held (one reference for this request, nothing more);
        every other key gets a fresh page (``reservation.new``), in key order. Waits up to
        ``timeout`` seconds for room, in the buffer and in ``tenant``'s share; raises
        :class:`TransferTimeout` then, and :class:`TooLarge` (or :class:`ShareTooSmall`) at
        once when the request could never fit the buffer (or the tenant's share).
        """
        deadline = time.monotonic() + timeout
        shares, waited = self.shares, False
        with self._cond:
            while True:
                pool = self.pool
                held, missing = self._index.split(keys)
                if len(missing) > self.num_pages:
                    raise TooLarge(
                        f"request {request_id!r} needs {len(missing)} chunks; the PD buffer holds "
                        f"{self.num_pages} (raise pd_buffer_size)"
                    )
                at_share = not shares.admit(request_id, tenant, len(keys), waited)
                fresh = None if at_share else pool.allocate(len(missing))
                if fresh is not None:
                    break
                waited = waited or at_share
                remaining = deadline - time.monotonic()
                if remaining <= 0 and at_share:
                    raise TransferTimeout(
                        shares.full_message(request_id, tenant, len(keys), timeout)
                    )
                if remaining <= 0:
                    raise TransferTimeout(
                        f"request {request_id!r}: no room for {len(missing)} chunks in the PD "
                        f"buffer within {timeout:g}s ({pool.free_pages} of {self.num_pages}"
                        " pages free)"
                    )
                self._cond.wait(remaining)
            held_pages = [self._index[keys[i]].page for i in held]
            pool.retain(held_pages)  # the one reference this request holds on each held chunk
            new: dict[int, ChunkKey] = {}
            for i, page in zip(missing, fresh, strict=True):
                self._index.add(keys[i], page, num_tokens[i])
                new[page] = keys[i]
            pages = fresh + held_pages
            shares.take(tenant, len(pages))
            return Reservation(self, request_id, pages, new, tenant), held

    def page_view(self, page: int, nbytes: int) -> torch.Tensor:
        return self.pool.page_bytes_view(page, nbytes)

    def publish(
        self, reservation: Reservation, page: int, expected: int, actual: int | None = None
    ) -> bool:
        """Verify a received chunk and make it visible to lookups. False (and the chunk is
        dropped, counted as corrupt) when its bytes do not match the sender's checksum.
        ``actual``: the checksum of the page's bytes when the transport hashed them as they
        landed (tcp); otherwise the page is hashed here, unless the channel defers that to
        serve time (``verify_at_serve``: shm), where :meth:`get_into` checks every byte."""
        key = reservation.new[page]
        with self._cond:
            entry = self._index.get(key)
            if entry is None or entry.page != page or reservation.released:
                return False
            nbytes = self.payload_bytes(entry.num_tokens)
            view = self.pool.page_bytes_view(page, nbytes)
        if actual is None and self.channel.verify_at_serve:
            actual = expected  # verified byte for byte as get_into copies it out
        if actual is None:
            # Hashed outside the lock (a 32 MiB page takes milliseconds, and other senders'
            # reserve/publish wait on this lock). The reservation owns the page; if it was
            # released meanwhile, the check below refuses the result whatever it was.
            actual = checksum(view)
        with self._cond:
            if self._index.get(key) is not entry or reservation.released:
                return False
            if actual != expected:
                log.error("PD chunk %s failed its checksum; dropped", key.hex())
                self.counters.corrupt += 1
                self._index.drop(key)
                return False
            entry.checksum = actual
            entry.ready = True
            self.counters.stored += 1
            self.counters.bytes_written += nbytes
            return True

    def count_transfer(self, ok: bool) -> None:
        """One request's transfer ended (the receiver reports it): ``kvtier_pd_transfers``."""
        self.count_event("transfers" if ok else "transfer_failures")

    def count_event(self, name: str, n: int = 1) -> None:
        """A receiver event for the tier's stats and /metrics: ``auth_failures``,
        ``timeouts``, ``protocol_errors``, ``expired_reservations``."""
        with self._cond:
            setattr(self.counters, name, getattr(self.counters, name) + n)

    def end_reservation(self, reservation: Reservation) -> None:
        """Give back ``reservation``'s references (its :meth:`~Reservation.release`, once)."""
        with self._cond:
            if self._pool is None:
                return  # closed: the whole pool is gone
            self._index.drop_unfilled(reservation.new)  # never filled: nobody may find them
            self.shares.give_back(reservation.tenant, len(reservation.pages))
            self._release(reservation.pages)

    def _release(self, pages: list[int]) -> None:
        """Give back references; drop the index entry of every page that became free."""
        pool = self.pool
        pool.release(pages)
        self._index.forget_free(pages, pool.refcount)
        self._cond.notify_all()

    # -- the Tier interface ----------------------------------------------------------------
    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        with self._cond:
            return [self._index.ready(k) for k in keys]

    def get_into(self, key: ChunkKey, out: torch.Tensor) -> int | None:
        """Copy a received chunk into ``out`` and check every byte against the sender's
        checksum in the same pass. ``out``: a flat uint8 view of at least the chunk's bytes,
        or (``serves_views``) a view of the caller's KV of exactly the chunk's shape."""
        with self._cond:
            entry = self._index.get(key)
            if entry is None or not entry.ready:
                self.counters.misses += 1
                return None
            nbytes = self.payload_bytes(entry.num_tokens)
            src = self.pool.page_bytes_view(entry.page, nbytes)
            # Copied and verified in one pass (serve_copy): on a mismatch out holds garbage,
            # but the caller serves nothing from a miss.
            if self._serving.copy(key, entry.num_tokens, src, out) != entry.checksum:
                log.error("PD chunk %s does not match its sender's checksum; dropped", key.hex())
                self.counters.corrupt += 1
                self._index.drop(key)  # its page goes back with its holders
                return None
            self.counters.hits += 1
            self.counters.bytes_read += nbytes
            return entry.num_tokens

    def put(self, job: PutJob) -> None:
        # The decoder keeps its buffer for what the prefiller sends; its own stores go to the
        # cache tiers. (An entry lives only while a request's reservation holds its page.)
        with self._cond:
            self.counters.dropped += 1
        job.done(PutOutcome.DROPPED, "the PD buffer is filled by the prefiller only")

    def remove(self, key: ChunkKey) -> bool:
        with self._cond:
            entry = self._index.get(key)
            if entry is None:
                return False
            self._index.drop(key)  # its page goes back with its holders
            return True

    def pin(self, key: ChunkKey) -> bool:
        with self._cond:
            entry = self._index.get(key)
            if entry is None or not entry.ready:
                return False
            self.pool.retain([entry.page])
            self._key_pins.record(key, entry.page)
            return True

    def unpin(self, key: ChunkKey) -> None:
        with self._cond:
            page = self._key_pins.take(key)
            if page is None:
                log.error("unpin of %s without a pin; ignored", key.hex())
                return
            self._release([page])

    def usage(self) -> TierUsage:
        with self._cond:
            used = self.pool.used_pages if self._pool is not None else 0
            return TierUsage(
                used * self.page_bytes, self.num_pages * self.page_bytes, len(self._index)
            )

    def clear(self) -> int:
        with self._cond:
            victims = [k for k, _ in self._index.items() if k not in self._key_pins]
            for key in victims:
                self._index.drop(key)  # its page goes back with its holders
            return len(victims)

    # -- inspection ------------------------------------------------------------------------
    def received_count(self, reservation: Reservation) -> int:
        """How many of the chunks ``reservation`` waits for have arrived, verified."""
        with self._cond:
            return self._index.received(reservation.new)

    def check_invariants(self, expected_refs: dict[int, int] | None = None) -> list[str]:
        """Problems as sentences (empty when fine): free list vs refcounts, index entries on
        free pages, and (given the owners' view) refcounts vs ``expected_refs``
        (:mod:`kvtier.pd.buffer_audit`)."""
        with self._cond:
            return page_problems(self.pool, self._index, self._key_pins, expected_refs)

    def audit(self, leases: LeaseTable[Any]) -> list[str]:
        """The engine's reference audit for this buffer: every page reference is owned by a
        live reservation in some request's lease or a key pin (with no request open, every
        reservation has been given back), and each tenant is charged for exactly those."""
        live = live_reservations(leases, self)
        expected = Counter(page for reservation in live for page in reservation.pages)
        problems = self.check_invariants(dict(expected))
        with self._cond:
            problems += self.shares.check_against(live)
        return [f"pd buffer: {problem}" for problem in problems]


def _tokens_per_page(payload_bytes: Callable[[int], int], page_bytes: int) -> int:
    """The most tokens a chunk in one page can have (payload_bytes grows with the count)."""
    lo, hi = 0, 1
    while payload_bytes(hi) <= page_bytes:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if payload_bytes(mid) <= page_bytes else (lo, mid)
    return lo
