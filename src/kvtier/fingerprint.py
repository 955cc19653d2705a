"""The fingerprint: everything that makes two KV caches incompatible, and the key hash ``H``.

Every chunk key's chain is seeded by ``H(fingerprint)`` (:mod:`kvtier.keys`), so keys of two
models, layouts, tensor-parallel ranks, tenants (the engine-wide ``cache_salt``) or lossy
codecs never match: a cache shared by a fleet holds them side by side. ``H`` is deterministic
across processes and machines (xxh3-128 by default; never Python's salted ``hash()``).

``canonical()`` is the exact byte string hashed: keys already stored depend on it, so a new
field enters it only when set (as ``lossy_codec`` does), leaving every existing key unchanged.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import xxhash

from kvtier.errors import InputError
from kvtier.layout import KVLayout, dtype_name

KEY_BYTES = 16  # every key and digest H makes (a ChunkKey's length)


def _blake3(data: bytes) -> bytes:
    import blake3  # imported lazily: only needed when configured

    return bytes(blake3.blake3(data).digest(length=KEY_BYTES))


HASHERS: dict[str, Callable[[bytes], bytes]] = {
    "xxh3_128": xxhash.xxh3_128_digest,
    "blake3": _blake3,
    "sha256": lambda data: hashlib.sha256(data).digest()[:KEY_BYTES],
}


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """Everything that makes two KV caches incompatible. Keys with another fingerprint never
    match, so a cache shared by a fleet can hold many models and tenants side by side."""

    model_name: str
    layout: KVLayout
    chunk_size: int
    hash_algorithm: str = "xxh3_128"
    tp_rank: int = 0
    tp_world_size: int = 1
    cache_salt: str = ""
    # A lossy payload codec the chunks were stored with (kvtier.storage.codecs): what a
    # reader gets back differs from the model's KV, so it is another cache. Empty for
    # identity and lossless codecs (any reader decodes those to the same bytes).
    lossy_codec: str = ""

    def __post_init__(self) -> None:
        if not self.model_name:
            raise InputError("model_name must be a non-empty string (it is part of every key)")
        if self.hash_algorithm not in HASHERS:
            raise InputError(
                f"hash algorithm {self.hash_algorithm!r} unknown; use one of {', '.join(HASHERS)}"
            )
        if not 0 <= self.tp_rank < self.tp_world_size:
            raise InputError(
                f"tp_rank {self.tp_rank} must be in [0, tp_world_size={self.tp_world_size})"
            )

    def canonical(self) -> bytes:
        """A stable byte string of every field (the seed of the chain)."""
        lay = self.layout
        # MLA KV is the same on every tensor-parallel rank: one copy serves every rank (and
        # every TP size), so the rank is left out and ranks share keys.
        tp = "tp-shared" if lay.tp_shared else f"tp{self.tp_rank}/{self.tp_world_size}"
        parts = [
            "kvtier-fp-1",
            self.model_name,
            f"{lay.num_layers}x{lay.num_kv_heads}x{lay.head_dim}",
            dtype_name(lay.dtype),
            str(self.chunk_size),
            self.hash_algorithm,
            tp,
            self.cache_salt,
        ]
        if lay.groups != KVLayout(lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.dtype).groups:
            # Every group's kind, window and layers (a one-group Llama-shaped layout keeps the
            # string it always had, so caches written before groups existed still match).
            parts.append(f"planes{lay.planes}|{lay.describe_groups()}")
        if self.lossy_codec:  # added only when set: keys without one are unchanged
            parts.append(f"lossy-codec={self.lossy_codec}")
        return "\x1f".join(parts).encode()

    def digest(self) -> bytes:
        return HASHERS[self.hash_algorithm](self.canonical())

    def hex(self) -> str:
        """Short stable id, used as a namespace in file and redis key names."""
        return self.digest()[:8].hex()
