"""Engine-wide event counters (per-tier counters live on each tier)."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvtier.storage.base import PutOutcome


@dataclass
class EngineCounters:
    requests: int = 0
    lookups: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0  # tokens loaded into the engine from kvtier (== retrieved_tokens)
    found_tokens: int = 0  # tokens lookups found in kvtier's tiers
    unused_tokens: int = 0  # found for a request that ended without loading them
    stores: int = 0
    stored_chunks: int = 0
    dropped_chunks: int = 0
    retrieved_tokens: int = 0
    load_failures: int = 0
    hit_tokens_by_tier: Counter[str] = field(default_factory=Counter)
    writes_by_tier: dict[str, Counter[str]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **amounts: int) -> None:
        """Add to named counters under the lock: requests on several threads (and tier I/O
        threads) count into one object, and ``+=`` on an attribute is not atomic."""
        with self._lock:
            for name, amount in amounts.items():
                setattr(self, name, getattr(self, name) + amount)

    def count_hit(self, tier: str, tokens: int) -> None:
        with self._lock:
            self.hit_tokens_by_tier[tier] += tokens

    def count_write(self, tier: str, outcome: PutOutcome) -> None:
        # Called from tier I/O threads.
        with self._lock:
            self.writes_by_tier.setdefault(tier, Counter())[outcome.value] += 1

    def as_dict(self) -> dict[str, Any]:
        with self._lock:
            writes = {t: dict(c) for t, c in self.writes_by_tier.items()}
        out: dict[str, Any] = {
            k: v for k, v in vars(self).items() if not k.startswith("_") and isinstance(v, int)
        }
        out["hit_tokens_by_tier"] = dict(self.hit_tokens_by_tier)
        out["writes_by_tier"] = writes
        return out
