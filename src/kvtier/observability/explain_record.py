"""One request's explain record: its chunks as runs of the same outcome (found in a tier, or
missed for a reason; see :mod:`kvtier.observability.explain`) and its tokens, counted as the
engine's counters count them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

# (first_index, last_index, found, tier_or_reason, detail): consecutive chunks with the same
# outcome share one run, so a 512-chunk prompt that misses from chunk 3 on is two runs.
Run = tuple[int, int, bool, str, str]


@dataclass
class RequestExplain:
    request_id: str
    fingerprint: str
    chunk_size: int
    prompt_tokens: int
    found_tokens: int  # found in kvtier's tiers by the last lookup
    keys: bytes  # 16 bytes per chunk, concatenated
    runs: list[Run]
    time: float = field(default_factory=time.time)
    lookups: int = 1
    keyed_by: str = ""
    loaded_tokens: int = 0  # copied into the engine since the lookup
    unused_tokens: int | None = None  # set when the request ends

    def counts(self) -> dict[str, Any]:
        """The request's tokens, named as the engine's counters name them."""
        ended = {} if self.unused_tokens is None else {"unused_tokens": self.unused_tokens}
        return {
            "prompt_tokens": self.prompt_tokens,
            "found_tokens": self.found_tokens,
            "loaded_tokens": self.loaded_tokens,
            **ended,
        }

    def chunk_rows(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        n_keys = len(self.keys) // 16
        for first, last, found, what, detail in self.runs:
            for i in range(first, last + 1):
                start = i * self.chunk_size
                row: dict[str, Any] = {
                    "index": i,
                    "start": start,
                    "end": min(start + self.chunk_size, self.prompt_tokens),
                    "key": self.keys[i * 16 : (i + 1) * 16].hex() if i < n_keys else None,
                    "found": found,
                }
                row["tier" if found else "reason"] = what
                if detail:
                    row["detail"] = detail
                rows.append(row)
        return rows

    def as_dict(self) -> dict[str, Any]:
        found: dict[str, int] = {}
        misses: dict[str, int] = {}
        for first, last, was_found, what, _ in self.runs:
            bucket = found if was_found else misses
            bucket[what] = bucket.get(what, 0) + last - first + 1
        return {
            "request_id": self.request_id,
            "time": self.time,
            "lookups": self.lookups,
            "fingerprint": self.fingerprint,
            "chunk_size": self.chunk_size,
            **self.counts(),
            **({"keyed_by": self.keyed_by} if self.keyed_by else {}),
            "summary": {"found_chunks_by_tier": found, "miss_chunks_by_reason": misses},
            "chunks": self.chunk_rows(),
        }


def append_run(runs: list[Run], index: int, found: bool, what: str, detail: str) -> None:
    if runs:
        first, last, f, w, d = runs[-1]
        if last == index - 1 and (f, w, d) == (found, what, detail):
            runs[-1] = (first, index, f, w, d)
            return
    runs.append((index, index, found, what, detail))
