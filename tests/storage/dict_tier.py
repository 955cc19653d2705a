"""A tier in a Python dict, for tests of the seams around tiers (the registry, an engine given
ready-made tiers). It passes :class:`~tests.storage.tier_contract.TierContract`
(``tests/storage/test_registry.py``), so what an engine does with it, it does with any tier.

``store`` may be shared between instances, as two engines share a remote store.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence

import torch

from kvtier.config import Config
from kvtier.fingerprint import Fingerprint
from kvtier.keys import ChunkKey
from kvtier.layout import KVLayout
from kvtier.storage.base import PutJob, PutOutcome, Tier, TierUsage

Store = dict[ChunkKey, tuple[bytes, int]]  # key -> (payload bytes, tokens)


class DictTier(Tier):
    name = "dict"
    medium = None  # a test tier: not published in KV events

    def __init__(self, store: Store | None = None, url: str = "") -> None:
        super().__init__()
        self.store: Store = store if store is not None else {}
        self.url = url  # the config value it was built from, if any
        self.state = "new"
        self._pins: Counter[ChunkKey] = Counter()
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, config: Config, layout: KVLayout, fingerprint: Fingerprint) -> DictTier:
        """The registry's factory: a fresh dict, remembering ``remote_url``."""
        return cls(url=config.remote_url or "")

    def open(self) -> None:
        self.state = "open"

    def close(self) -> None:
        self.state = "closed"

    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        with self._lock:
            return [key in self.store for key in keys]

    def get_into(self, key: ChunkKey, out: torch.Tensor) -> int | None:
        with self._lock:
            item = self.store.get(key)
        if item is None:
            self.counters.misses += 1
            return None
        data, tokens = item
        out[: len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.counters.hits += 1
        self.counters.bytes_read += len(data)
        return tokens

    def put(self, job: PutJob) -> None:
        key, payload, num_tokens = job.key, job.payload, job.num_tokens
        with self._lock:
            if key in self.store:
                outcome = PutOutcome.EXISTS
            else:
                self.store[key] = (payload.numpy().tobytes(), num_tokens)
                self.counters.stored += 1
                self.counters.bytes_written += payload.numel()
                outcome = PutOutcome.STORED
        job.done(outcome)

    def remove(self, key: ChunkKey) -> bool:
        with self._lock:
            if self._pins[key]:
                return False
            return self.store.pop(key, None) is not None

    def pin(self, key: ChunkKey) -> bool:
        with self._lock:
            if key not in self.store:
                return False
            self._pins[key] += 1
            return True

    def unpin(self, key: ChunkKey) -> None:
        with self._lock:
            self._pins[key] -= 1
            if self._pins[key] <= 0:
                del self._pins[key]

    def usage(self) -> TierUsage:
        with self._lock:
            used = sum(len(data) for data, _ in self.store.values())
            return TierUsage(used, max(used, 1 << 30), len(self.store))

    def clear(self) -> int:
        with self._lock:
            gone = [key for key in self.store if not self._pins[key]]
            for key in gone:
                del self.store[key]
            return len(gone)
