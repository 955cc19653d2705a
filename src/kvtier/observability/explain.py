"""Why a request's chunks were found or missed, chunk by chunk: a bounded record of recent
lookups.

For each lookup the engine makes, :class:`ExplainLog` records one row per chunk of the prompt:
the tier it was found in, or the reason it missed. A record counts tokens as the engine's
counters do: ``found_tokens`` (found by the lookup in kvtier's tiers, beyond what the engine
said it holds), ``loaded_tokens`` (copied into the engine since: the hit) and, once the
request ended, ``unused_tokens`` (found, never loaded: the engine had them). The reasons a
chunk missed, and what each one means exactly:

``not stored``
    No tier holds the chunk, and this process has no record of it ever being stored, dropped,
    evicted or found corrupt under this fingerprint or any other.
``evicted``
    No tier holds it now, but this process stored it earlier. When a tier evicted it (every
    tier reports the keys it evicts, through ``Tier.add_evict_listener``) the detail names the
    tier and when; otherwise it names what else can lose a chunk, by the tiers there are
    (:func:`unreported_loss`): removed or cleared; a write to a lower tier dropped or failed;
    a shared store (Redis, S3) deleting it itself, which no client can see.
``quota``
    No tier holds it now: it was evicted because its tenant (the request's ``cache_salt``)
    was over its ``tenant_quotas`` limit in that tier; the detail names the tier, the tenant
    and when. (Evictions to make room for others say ``evicted``.)
``store dropped``
    The last store of this chunk was dropped because every CPU page was pinned (it never
    reached a tier).
``fingerprint mismatch``
    The same tokens (same chunk boundaries) were stored in this process under another
    fingerprint: another model name, layout, dtype, hash algorithm, tensor-parallel rank or
    world size, or cache salt. The detail names the fields that differ. Only stores made in
    this process are known; a fleet sharing a remote store sees ``not stored`` instead.
``checksum failure``
    The chunk failed its checksum when read (the tier removed it): at this request's retrieve,
    or in an earlier read. For a model whose chunks hold KV-cache groups in parts (a trimmed
    sliding-window group), the detail names the group whose bytes differed, e.g. ``(KV-cache
    group sliding/w128/k160:0,2)``: kind, window, tokens kept, layers. A chunk's groups share
    one record, so a chunk is all its groups or a miss, never a partial state.
``not contiguous``
    A tier holds the chunk, but a chunk before it missed, so it cannot be used (chunk ``i``
    needs chunks ``0..i-1``). Also: a hit dropped because an earlier chunk failed to load.
``lost at retrieve``
    The lookup found the chunk in a lower tier but the read at retrieve missed (removed
    meanwhile, tier unreachable, or no free CPU page to load it into).
``changed during lookup``
    A tier holds it now but the lookup did not pin it (it appeared, or was evicted and stored
    again, while the lookup ran).
``partial chunk``
    The last tokens do not fill a chunk and ``save_unfull_chunk`` is off: never cached.

A record's ``keyed_by`` names what besides its tokens keyed the request apart ("cache salt",
"lora adapter 'B'", "2 images", "prompt embeddings"; absent for plain tokens): equal tokens
under other keys are other chunks, so a miss there is by design.

Found chunks name their tier; chunks inside ``skip_leading_tokens`` show tier ``engine`` (the
engine already held them). Memory is bounded: the last ``capacity`` requests and the fate of
the last ``key_memory`` keys (oldest forgotten first).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvtier.fingerprint import Fingerprint
from kvtier.keys import ChunkKey, ChunkSpan, ChunkSpans
from kvtier.observability.explain_record import RequestExplain, Run, append_run
from kvtier.observability.fingerprints import (
    FINGERPRINTS,
    FingerprintRegistry,
    fingerprint_diff,
    token_chain,
)
from kvtier.tokens import as_token_array

NOT_STORED = "not stored"
EVICTED = "evicted"
QUOTA = "quota"
STORE_DROPPED = "store dropped"
FINGERPRINT_MISMATCH = "fingerprint mismatch"
CHECKSUM_FAILURE = "checksum failure"
NOT_CONTIGUOUS = "not contiguous"
LOST_AT_RETRIEVE = "lost at retrieve"
CHANGED = "changed during lookup"
PARTIAL = "partial chunk"
REASONS = (
    NOT_STORED,
    EVICTED,
    QUOTA,
    STORE_DROPPED,
    FINGERPRINT_MISMATCH,
    CHECKSUM_FAILURE,
    NOT_CONTIGUOUS,
    LOST_AT_RETRIEVE,
    CHANGED,
    PARTIAL,
)

GROUP_MARK = " in KV-cache group "  # how a tier's corruption reason names the group

# What the log remembers about a key: the last thing that happened to it.
_STORED, _EVICTED, _DROPPED, _CORRUPT = "stored", "evicted", "dropped", "corrupt"
_QUOTA = "quota"

Probe = Callable[[Sequence[ChunkKey]], list[str | None]]


class ExplainLog:
    """Bounded lookup records for one engine. Thread-safe; every method is O(chunks)."""

    def __init__(
        self,
        fingerprint: Fingerprint,
        *,
        save_unfull_chunk: bool,
        capacity: int = 1000,
        key_memory: int = 100_000,
        registry: FingerprintRegistry = FINGERPRINTS,
    ) -> None:
        self.fingerprint = fingerprint
        self._digest = fingerprint.digest()  # computed once: it is on every lookup's path
        self._hex = fingerprint.hex()
        self.chunk_size = fingerprint.chunk_size
        self.save_unfull_chunk = save_unfull_chunk
        self.capacity = capacity
        self.key_memory = key_memory
        self.registry = registry
        self._records: OrderedDict[str, RequestExplain] = OrderedDict()
        self._fate: OrderedDict[ChunkKey, tuple[str, str, float]] = OrderedDict()
        self._unreported = unreported_loss(lower=[], shared=[])  # until describe_tiers
        self._lock = threading.Lock()

    def describe_tiers(self, *, lower: Sequence[str], shared: Sequence[str]) -> None:
        """The engine's tiers below the CPU one, and those of them a fleet shares: what a
        chunk that vanished without a reported eviction may have gone through."""
        self._unreported = unreported_loss(lower=lower, shared=shared)

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    # -- events ----------------------------------------------------------------------------
    def _note(self, keys: Iterable[ChunkKey], event: str, tier: str) -> None:
        now = time.time()
        with self._lock:
            for key in keys:
                self._fate[key] = (event, tier, now)
                self._fate.move_to_end(key)
            while len(self._fate) > self.key_memory:
                self._fate.popitem(last=False)

    def note_evicted(self, tier: str, keys: Sequence[ChunkKey]) -> None:
        self._note(keys, _EVICTED, tier)

    def note_quota_evicted(self, tier: str, tenants: dict[ChunkKey, str]) -> None:
        """``tenants``' keys were evicted from ``tier`` because each one's tenant was over
        its quota there."""
        now = time.time()
        with self._lock:
            for key, tenant in tenants.items():
                self._fate[key] = (_QUOTA, f"{tier}\x1f{tenant}", now)
                self._fate.move_to_end(key)
            while len(self._fate) > self.key_memory:
                self._fate.popitem(last=False)

    def note_corrupt(self, tier: str, keys: Sequence[ChunkKey]) -> None:
        self._note(keys, _CORRUPT, tier)

    def note_store(self, tokens: object, spans: Sequence[ChunkSpan], dropped: int) -> None:
        """``spans`` were offered to the tiers; the last ``dropped`` of them found no page."""
        if not self.enabled or not spans:
            return
        kept = spans[: len(spans) - dropped]
        self._note((s.key for s in kept), _STORED, "")
        self._note((s.key for s in spans[len(kept) :]), _DROPPED, "")
        chains = token_chain(tokens, self.chunk_size, spans[-1].index + 1)
        self.registry.add((chains[s.index] for s in kept), self._digest, self.fingerprint)

    def record_lookup(
        self,
        request_id: str,
        tokens: object,
        spans: Sequence[ChunkSpan],
        runs: Sequence[tuple[str, int, int]],
        found_tokens: int,
        probe: Probe,
        keyed_by: str = "",
    ) -> None:
        """Record one lookup. ``runs`` is the pinned prefix as (tier name, first chunk, end
        chunk), chunk indices into ``spans``; ``probe`` answers, for keys, which tier holds
        each now (one batched contains per tier). O(runs) for the hits, so a long cached
        prompt costs no Python per chunk here."""
        if not self.enabled:
            return
        prompt_tokens = len(as_token_array(tokens))
        first_index = spans[0].index if spans else 0
        record_runs: list[Run] = [
            (first_index + first, first_index + end - 1, True, tier, "")
            for tier, first, end in runs
            if end > first
        ]
        hit_chunks = runs[-1][2] if runs else 0
        missing = spans[hit_chunks:]
        if missing:
            self._explain_misses(tokens, missing, probe, record_runs)
        full = len(spans)
        if prompt_tokens > full * self.chunk_size:  # a tail that is not a stored chunk
            detail = f"the last {prompt_tokens - full * self.chunk_size} tokens do not fill a chunk"
            append_run(record_runs, full, False, PARTIAL, detail + "; save_unfull_chunk is off")
        keys = spans.keys if isinstance(spans, ChunkSpans) else [s.key for s in spans]
        record = RequestExplain(
            request_id,
            self._hex,
            self.chunk_size,
            prompt_tokens,
            found_tokens,
            b"".join(keys),
            record_runs,
            keyed_by=keyed_by,
        )
        with self._lock:
            old = self._records.pop(request_id, None)
            if old is not None:  # a request looked up again (vLLM: preempted, resumed)
                record.lookups = old.lookups + 1
                record.loaded_tokens = old.loaded_tokens
            self._records[request_id] = record
            while len(self._records) > self.capacity:
                self._records.popitem(last=False)

    def _explain_misses(
        self, tokens: object, missing: Sequence[ChunkSpan], probe: Probe, runs: list[Run]
    ) -> None:
        where = probe([s.key for s in missing])
        with self._lock:
            fates = [self._fate.get(s.key) for s in missing]
        chains: list[bytes] | None = None
        check_fingerprints = self.registry.may_have_others(self._digest)
        first_missing = missing[0].index
        for span, tier, fate in zip(missing, where, fates, strict=True):
            if tier is not None:
                if span.index == first_missing:
                    append_run(runs, span.index, False, CHANGED, f"held by {tier} now")
                else:
                    detail = f"held by {tier}, but chunk {first_missing} before it missed"
                    append_run(runs, span.index, False, NOT_CONTIGUOUS, detail)
                continue
            if fate is not None:
                event, fate_tier, when = fate
                reason = _fate_reason(event, fate_tier, when, self._unreported)
                append_run(runs, span.index, False, *reason)
                continue
            others: list[Fingerprint] = []
            if check_fingerprints:
                if chains is None:
                    chains = token_chain(tokens, self.chunk_size, missing[-1].index + 1)
                others = self.registry.others(chains[span.index], self._digest)
            if others:
                detail = fingerprint_diff(self.fingerprint, others[0])
                append_run(runs, span.index, False, FINGERPRINT_MISMATCH, detail)
            else:
                append_run(runs, span.index, False, NOT_STORED, "")

    def record_load(
        self,
        request_id: str,
        hits: Sequence[tuple[ChunkSpan, str]],
        loaded_end: int,
        corrupt_tiers: set[str],
        why: Callable[[str, ChunkKey], str | None] | None = None,
        copied: int = 0,
    ) -> None:
        """A retrieve copied ``copied`` tokens, up to ``loaded_end`` of the lookup's
        ``hits``: the first chunk that did not load failed its checksum (when its tier
        counted one) or was lost. ``why(tier, key)``: the tier's reason for a corrupt entry;
        when it names a KV-cache group (``in KV-cache group sliding/w128/k160:0,2``), the
        detail names it too."""
        if not self.enabled:
            return
        with self._lock:
            record = self._records.get(request_id)
            if record is not None:
                record.loaded_tokens += copied
        failed = [(span, tier) for span, tier in hits if span.end > loaded_end]
        if not failed:
            return
        first_span, first_tier = failed[0]
        corrupt = first_tier in corrupt_tiers
        group = ""
        if corrupt:
            self.note_corrupt(first_tier, [first_span.key])
            reason = why(first_tier, first_span.key) if why is not None else None
            if reason and GROUP_MARK in reason:
                group = reason[reason.index(GROUP_MARK) + len(GROUP_MARK) :]
        with self._lock:
            record = self._records.get(request_id)
            if record is None:
                return
            rows = {i: (h, w, d) for f, last, h, w, d in record.runs for i in range(f, last + 1)}
            for span, tier in failed:
                if span is first_span:
                    reason = CHECKSUM_FAILURE if corrupt else LOST_AT_RETRIEVE
                    where = f" (KV-cache group {group})" if group else ""
                    rows[span.index] = (
                        False,
                        reason,
                        f"found in {tier} at lookup; its read failed{where}",
                    )
                else:
                    detail = f"held by {tier}, but chunk {first_span.index} failed to load"
                    rows[span.index] = (False, NOT_CONTIGUOUS, detail)
            runs: list[Run] = []
            for i in sorted(rows):
                append_run(runs, i, *rows[i])
            record.runs = runs

    def record_end(self, request_id: str, unused_tokens: int) -> None:
        """The request ended with ``unused_tokens`` found and never loaded."""
        with self._lock:
            record = self._records.get(request_id)
            if record is not None:
                record.unused_tokens = unused_tokens

    # -- queries ---------------------------------------------------------------------------
    def get(self, request_id: str) -> dict[str, Any] | None:
        """The record of ``request_id``, or of the newest request whose id it names: vLLM's
        OpenAI server answers a client with ``cmpl-<id>`` and runs the request as
        ``cmpl-<id>-<n>-<suffix>`` (and a kvtier server keys it ``c<conn>/...``), so the
        id the client knows finds the record too."""
        with self._lock:
            record = self._records.get(request_id)
            if record is None and request_id:
                for candidate in reversed(self._records.values()):
                    if _names(request_id, candidate.request_id):
                        record = candidate
                        break
            return record.as_dict() if record is not None else None

    def recent(self, limit: int) -> list[dict[str, Any]]:
        """Newest first: id, time, prompt, found, loaded and (ended) unused tokens (no
        per-chunk rows)."""
        with self._lock:
            records = list(self._records.values())[-limit:] if limit > 0 else []
            return [
                {"request_id": r.request_id, "time": r.time, **r.counts()}
                for r in reversed(records)
            ]

    def __len__(self) -> int:
        return len(self._records)


def _names(given: str, full: str) -> bool:
    """True when ``full`` is the internal id of the request the client calls ``given``:
    ``given-...``, optionally after a kvtier server's ``c<conn>/`` prefix."""
    local = full.split("/", 1)[1] if full.startswith("c") and "/" in full else full
    return local == given or local.startswith(given + "-")


def unreported_loss(*, lower: Sequence[str], shared: Sequence[str]) -> str:
    """How a stored chunk can leave every tier with no eviction reported, naming only the
    tiers there are: ``lower`` take their writes in the background (a write can be dropped
    when busy or full, or fail); ``shared`` stores are also deleted from by their server's
    own eviction or by another client, which this process cannot see."""
    causes = ["removed or cleared (POST /clear)"]
    if lower:
        causes.append(f"its write to {' or '.join(lower)} was dropped or failed")
    if shared:
        causes.append(
            f"deleted from {' or '.join(shared)} outside this process (the store's own "
            "eviction, or another client)"
        )
    return "no eviction was reported: " + ", or ".join(causes)


def _fate_reason(event: str, tier: str, when: float, unreported: str) -> tuple[str, str]:
    stamp = time.strftime("%H:%M:%S", time.localtime(when))
    if event == _EVICTED:
        return EVICTED, f"evicted from {tier} at {stamp}"
    if event == _QUOTA:
        where, _, tenant = tier.partition("\x1f")
        return QUOTA, f"evicted from {where} at {stamp}: tenant {tenant!r} was over its quota"
    if event == _CORRUPT:
        return CHECKSUM_FAILURE, f"failed its checksum in {tier} at {stamp} and was removed"
    if event == _DROPPED:
        return STORE_DROPPED, f"store at {stamp} dropped: every CPU page was pinned"
    return EVICTED, f"stored at {stamp}; no tier holds it now and {unreported}"
