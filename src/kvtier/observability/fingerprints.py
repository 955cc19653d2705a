"""Which fingerprints stored which tokens in this process, for explain's ``fingerprint
mismatch``: a chunk missed under this engine's fingerprint while the same tokens (same chunk
boundaries) were stored under another (another model name, layout, dtype, hash, TP rank or
world size, or cache salt). Keyed by a fingerprint-free chain hash of the tokens, bounded.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import fields

import xxhash

from kvtier.fingerprint import Fingerprint
from kvtier.tokens import as_token_array


def token_chain(tokens: object, chunk_size: int, count: int) -> list[bytes]:
    """Fingerprint-free chain hashes of the first ``count`` chunks: equal tokens, equal hashes,
    whatever the model. Used only to recognise a fingerprint mismatch."""
    data = as_token_array(tokens).tobytes()
    step = chunk_size * 4
    prev = b"kvtier-token-chain"
    out: list[bytes] = []
    for i in range(count):
        prev = xxhash.xxh3_128_digest(prev + data[i * step : (i + 1) * step])
        out.append(prev)
    return out


class FingerprintRegistry:
    """Process-wide: token-chain hash -> the fingerprints that stored those tokens (bounded)."""

    def __init__(self, capacity: int = 100_000) -> None:
        self.capacity = capacity
        self._by_chain: OrderedDict[bytes, dict[bytes, Fingerprint]] = OrderedDict()
        self._digests: set[bytes] = set()  # every fingerprint that ever stored here
        self._lock = threading.Lock()

    def add(self, chains: Iterable[bytes], digest: bytes, fingerprint: Fingerprint) -> None:
        with self._lock:
            self._digests.add(digest)
            for chain in chains:
                fps = self._by_chain.setdefault(chain, {})
                fps[digest] = fingerprint
                self._by_chain.move_to_end(chain)
            while len(self._by_chain) > self.capacity:
                self._by_chain.popitem(last=False)

    def may_have_others(self, digest: bytes) -> bool:
        """False while only ``digest`` ever stored (one engine per process): then no lookup
        needs the token chain at all."""
        with self._lock:
            return bool(self._digests - {digest})

    def others(self, chain: bytes, digest: bytes) -> list[Fingerprint]:
        """Fingerprints other than ``digest`` that stored the tokens of ``chain``."""
        with self._lock:
            fps = self._by_chain.get(chain, {})
            return [fp for d, fp in fps.items() if d != digest]


FINGERPRINTS = FingerprintRegistry()


def fingerprint_diff(mine: Fingerprint, other: Fingerprint) -> str:
    parts = []
    for f in fields(Fingerprint):
        a, b = getattr(mine, f.name), getattr(other, f.name)
        if a != b:
            parts.append(f"{f.name} {b!r} (this engine: {a!r})")
    return "stored under " + ", ".join(parts) if parts else "stored under another fingerprint"
