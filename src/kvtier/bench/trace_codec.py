"""``kvtier bench trace --codec``: the trace replayed through kvtier's coded CPU tier
(:class:`~kvtier.storage.cpu_coded.CodedCpuTier`, what ``cpu_codec`` builds), its capacity
counted in bytes.

What is real and what is scaled. The RAM is ``--capacity`` of the trace's unique blocks at
the reference layout's bytes (a Llama-3-8B rank, ``trace.REFERENCE``: 32 MiB a 512-token
bf16 block). It is split as the engine splits ``max_local_cpu_size``
(:func:`~kvtier.storage.cpu_coded.split_capacity`): staging pages (``--codec-staging``, by
default the config's 1/16) and slots of the reference layout's stored chunk (one slot a
chunk for fp8 and int8, 1/16 of a chunk for lossless). The tier, its slot pool, its policy,
its checksums and the codec then run for real, on a *scaled* block: the same heads, head
dim and dtype, one layer and :data:`MINI_TOKENS` tokens (a quantised codec's ratio depends
only on those: scales per token and head), with synthetic KV
(:func:`kvtier.bench.codec_data.synthetic_kv`). Per request::

    lookup   pin_many(the prompt's keys) -> h, marked used; each of the h chunks is decoded
             (checksum first) into one staging page, as a load into a tensor recycles it
    store    make_room for the blocks not cached (the policy's victims go first, as the
             engine's store evicts), then each encoded into slots (insert)

So the figures count what the coded tier really keeps in those bytes: slot rounding, the
staging share, a lossless entry's variable size, and a decode of every hit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.bench.codec_data import synthetic_kv
from kvtier.bench.trace_file import Trace
from kvtier.bench.trace_sims import replay
from kvtier.fingerprint import Fingerprint
from kvtier.keys import ChunkKey
from kvtier.layout import KVLayout
from kvtier.memory.block_pool import BlockPool
from kvtier.storage.codecs import PayloadCodec
from kvtier.storage.cpu_coded import STAGING_SHARE, CodedCpuTier, slot_shape, split_capacity
from kvtier.storage.policy import make_policy

MINI_TOKENS = 4  # tokens of the scaled block (the u32 token count costs 0.05 % of fp8's ratio)


class CodedReplay:
    """The coded CPU tier behind the replay interface (module docstring)."""

    def __init__(
        self,
        codec: PayloadCodec,
        reference: KVLayout,
        block_tokens: int,
        ram_bytes: int,
        staging: float,
        policy: str,
        whole_tokens: int,
    ) -> None:
        block_bytes = reference.payload_bytes(block_tokens)
        shape = slot_shape(codec, reference, block_tokens)
        pages, slots = split_capacity(ram_bytes, int(staging * ram_bytes), block_bytes, shape)
        self.staging_pages, self.slots = pages, slots
        self.mini = KVLayout(1, reference.num_kv_heads, reference.head_dim, reference.dtype)
        mini_slot, _ = slot_shape(codec, self.mini, MINI_TOKENS)
        pool = BlockPool(1, self.mini.chunk_bytes(MINI_TOKENS))  # loads and stores reuse it
        fp = Fingerprint("trace", self.mini, MINI_TOKENS)
        self.tier = CodedCpuTier(
            pool, BlockPool(slots, mini_slot), self.mini, codec, fp, make_policy(policy)
        )
        self.page = pool.page_bytes_view(0)
        self.kv = synthetic_kv(self.mini, MINI_TOKENS).reshape(-1).view(torch.uint8)
        self.whole_tokens = whole_tokens
        self.keys: dict[int, ChunkKey] = {}
        self.decoded = 0

    def _keys(self, ids: Sequence[int]) -> list[ChunkKey]:
        keys = self.keys
        return [keys.get(b) or keys.setdefault(b, b.to_bytes(16, "little")) for b in ids]

    def lookup(self, ids: Sequence[int]) -> int:
        keys = self._keys(ids)
        pinned = self.tier.pin_many(keys)
        try:
            for i, key in enumerate(keys[:pinned]):
                if self.tier.get_into(key, self.page) != MINI_TOKENS:
                    return i  # a corrupt entry is a miss (never here: nothing corrupts it)
                self.decoded += 1
            return pinned
        finally:
            self.tier.unpin_many(keys[:pinned])

    def store(self, ids: Sequence[int], start: int, tokens: Sequence[int]) -> None:
        tier, whole = self.tier, self.whole_tokens
        keys = self._keys(ids[start:])
        missing = [
            key
            for key, n, present in zip(keys, tokens[start:], tier.contains(keys), strict=True)
            if not present and n >= whole
        ]
        tier.make_room(len(missing))  # as StorageManager.store does before its inserts
        for key in missing:
            self.page.copy_(self.kv)  # what the engine's store copies in
            pages = tier.allocate(1)
            assert pages is not None  # one page, returned by every insert below
            if not tier.insert(key, pages[0], MINI_TOKENS):
                tier.pool.release(pages)

    def close(self) -> None:
        self.tier.close()


def coded_hit_ratio(
    trace: Trace,
    codec: PayloadCodec,
    reference: KVLayout,
    ram_bytes: int,
    policy: str,
    save_unfull: bool,
    staging: float = 1 / STAGING_SHARE,
) -> dict[str, float | int]:
    """The coded CPU tier's figures over ``trace`` in ``ram_bytes`` (module docstring)."""
    cache = CodedReplay(
        codec,
        reference,
        trace.block_tokens,
        ram_bytes,
        staging,
        policy,
        0 if save_unfull else trace.block_tokens,
    )
    try:
        hit = replay(trace, cache)
        usage = cache.tier.usage()
        entries = max(usage.entries, 1)
        return {
            "codec_hit_ratio": hit,
            "codec_staging_pages": cache.staging_pages,
            "codec_slots": cache.slots,
            "codec_entries_at_end": usage.entries,
            "codec_slots_per_entry": usage.used_bytes / cache.tier.store.page_bytes / entries,
            "codec_decoded_hits": cache.decoded,
            "codec_corrupt": cache.tier.counters.corrupt,
        }
    finally:
        cache.close()
